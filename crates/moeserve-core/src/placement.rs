//! Expert placement for expert parallelism: per MoE layer, which logical expert (the model's
//! index) each physical slot holds and which device the slot lives on. A logical expert may
//! have several slots (replicas of a hot expert); its tokens are split across them. Layout and
//! vocabulary follow DeepSeek's EPLB (`physical_to_logical`, `logical_to_physical`).
//!
//! Built by named constructors (`round_robin`, `new`, `from_json_file`) that validate, so a
//! placement in hand is always consistent. JSON format (`--expert-placement FILE`):
//!
//! ```json
//! { "num_devices": 2, "num_experts": 4,
//!   "layers": [ { "physical_to_logical": [0, 1, 2, 3, 0],
//!                 "physical_to_device":  [0, 1, 0, 1, 1] } ] }
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{DeviceId, ExpertId};

/// A placement file or table that cannot be used; says what is wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("expert placement {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("expert placement {origin}: malformed JSON: {source}")]
    Json {
        origin: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("expert placement {origin}: {message}")]
    Invalid { origin: String, message: String },
}

/// One layer's slots: `physical_to_logical[p]` lives on `physical_to_device[p]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerPlacement {
    /// `[num_physical]`
    pub physical_to_logical: Vec<ExpertId>,
    /// `[num_physical]`
    pub physical_to_device: Vec<DeviceId>,
}

/// The JSON form; `ExpertPlacement` serializes as this too.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlacementFile {
    num_devices: usize,
    num_experts: usize,
    layers: Vec<LayerPlacement>,
}

/// Logical expert → physical slots → devices, per layer.
///
/// Invariants: every logical expert of every layer has at least one slot; every device id is
/// below `num_devices`; `logical_to_physical` is the inverse of `physical_to_logical`, with
/// slots in ascending order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertPlacement {
    num_devices: usize,
    num_experts: usize,
    layers: Vec<LayerPlacement>,
    /// `[num_layers][num_experts]` → physical slots, ascending.
    logical_to_physical: Vec<Vec<Vec<usize>>>,
}

const IN_MEMORY: &str = "(in memory)";

/// The file format (`to_json`), for embedding a placement in larger JSON documents.
impl Serialize for ExpertPlacement {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct View<'a> {
            num_devices: usize,
            num_experts: usize,
            layers: &'a [LayerPlacement],
        }
        View {
            num_devices: self.num_devices,
            num_experts: self.num_experts,
            layers: &self.layers,
        }
        .serialize(serializer)
    }
}

impl ExpertPlacement {
    /// Validates `layers` and builds the inverse map.
    pub fn new(
        num_devices: usize,
        num_experts: usize,
        layers: Vec<LayerPlacement>,
    ) -> Result<Self, PlacementError> {
        Self::validated(IN_MEMORY, num_devices, num_experts, layers)
    }

    /// The start-up layout: slots are dealt to devices round-robin (slot `p` on device
    /// `p % num_devices`), slot `e < num_experts` holds expert `e`, and each of the
    /// `num_redundant` extra slots holds a replica of the expert with the fewest replicas so
    /// far (lowest index first) that lives on another device, so a replica adds capacity where
    /// its original is not (any expert when none lives elsewhere). EPLB re-plans them later.
    pub fn round_robin(
        num_layers: usize,
        num_experts: usize,
        num_devices: usize,
        num_redundant: usize,
    ) -> Result<Self, PlacementError> {
        let num_physical = num_experts + num_redundant;
        let device = |p: usize| DeviceId((p % num_devices.max(1)) as u32);
        let mut logical: Vec<ExpertId> = (0..num_experts as u32).map(ExpertId).collect();
        let mut replicas = vec![1usize; num_experts];
        for p in num_experts..num_physical {
            let elsewhere = |e: &usize| num_devices <= 1 || device(*e) != device(p);
            let fewest = |candidates: &mut dyn Iterator<Item = usize>| {
                candidates.min_by_key(|e| (replicas[*e], *e))
            };
            let pick = fewest(&mut (0..num_experts).filter(elsewhere))
                .or_else(|| fewest(&mut (0..num_experts)));
            let Some(e) = pick else { break };
            replicas[e] += 1;
            logical.push(ExpertId(e as u32));
        }
        let layer = LayerPlacement {
            physical_to_device: (0..logical.len()).map(device).collect(),
            physical_to_logical: logical,
        };
        Self::new(num_devices, num_experts, vec![layer; num_layers])
    }

    pub fn from_json_str(json: &str) -> Result<Self, PlacementError> {
        Self::parse("(inline JSON)", json)
    }

    pub fn from_json_file(path: &Path) -> Result<Self, PlacementError> {
        let origin = path.display().to_string();
        let json = std::fs::read_to_string(path).map_err(|source| PlacementError::Io {
            path: origin.clone(),
            source,
        })?;
        Self::parse(&origin, &json)
    }

    /// The placement as pretty JSON, readable by `from_json_str`.
    pub fn to_json(&self) -> String {
        let file = PlacementFile {
            num_devices: self.num_devices,
            num_experts: self.num_experts,
            layers: self.layers.clone(),
        };
        serde_json::to_string_pretty(&file).expect("a placement is plain numbers and lists")
    }

    pub fn write_json_file(&self, path: &Path) -> Result<(), PlacementError> {
        std::fs::write(path, self.to_json() + "\n").map_err(|source| PlacementError::Io {
            path: path.display().to_string(),
            source,
        })
    }

    pub fn num_devices(&self) -> usize {
        self.num_devices
    }

    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn num_physical(&self, layer: usize) -> usize {
        self.layers[layer].physical_to_logical.len()
    }

    pub fn layer(&self, layer: usize) -> &LayerPlacement {
        &self.layers[layer]
    }

    /// `[num_physical]`: the logical expert each slot of `layer` holds.
    pub fn physical_to_logical(&self, layer: usize) -> &[ExpertId] {
        &self.layers[layer].physical_to_logical
    }

    /// `[num_physical]`: the device each slot of `layer` lives on.
    pub fn physical_to_device(&self, layer: usize) -> &[DeviceId] {
        &self.layers[layer].physical_to_device
    }

    /// The slots holding `logical` in `layer`, ascending (at least one).
    pub fn logical_to_physical(&self, layer: usize, logical: ExpertId) -> &[usize] {
        &self.logical_to_physical[layer][logical.0 as usize]
    }

    pub fn num_replicas(&self, layer: usize, logical: ExpertId) -> usize {
        self.logical_to_physical(layer, logical).len()
    }

    /// The slot that computes the `token_ordinal`-th pair routed to `logical` this step
    /// (the pair's index among that expert's pairs, in token order): replicas take turns, so
    /// tokens split evenly and deterministically.
    pub fn slot_for(&self, layer: usize, logical: ExpertId, token_ordinal: usize) -> usize {
        let slots = self.logical_to_physical(layer, logical);
        slots[token_ordinal % slots.len()]
    }

    pub fn device_of(&self, layer: usize, physical: usize) -> DeviceId {
        self.layers[layer].physical_to_device[physical]
    }

    fn parse(origin: &str, json: &str) -> Result<Self, PlacementError> {
        let file: PlacementFile =
            serde_json::from_str(json).map_err(|source| PlacementError::Json {
                origin: origin.to_string(),
                source,
            })?;
        Self::validated(origin, file.num_devices, file.num_experts, file.layers)
    }

    fn validated(
        origin: &str,
        num_devices: usize,
        num_experts: usize,
        layers: Vec<LayerPlacement>,
    ) -> Result<Self, PlacementError> {
        let invalid = |message: String| PlacementError::Invalid {
            origin: origin.to_string(),
            message,
        };
        if num_devices == 0 || num_experts == 0 {
            return Err(invalid(format!(
                "num_devices ({num_devices}) and num_experts ({num_experts}) must be at least 1"
            )));
        }
        let mut logical_to_physical = Vec::with_capacity(layers.len());
        for (l, layer) in layers.iter().enumerate() {
            let (logical, devices) = (&layer.physical_to_logical, &layer.physical_to_device);
            if logical.len() != devices.len() {
                return Err(invalid(format!(
                    "layer {l}: physical_to_logical has {} slots but physical_to_device has {}",
                    logical.len(),
                    devices.len()
                )));
            }
            let mut slots = vec![Vec::new(); num_experts];
            for (p, (e, d)) in logical.iter().zip(devices).enumerate() {
                if e.0 as usize >= num_experts {
                    return Err(invalid(format!(
                        "layer {l}, slot {p}: expert {} is out of range (num_experts = {num_experts})",
                        e.0
                    )));
                }
                if d.0 as usize >= num_devices {
                    return Err(invalid(format!(
                        "layer {l}, slot {p}: device {} is out of range (num_devices = {num_devices})",
                        d.0
                    )));
                }
                slots[e.0 as usize].push(p);
            }
            if let Some(e) = slots.iter().position(Vec::is_empty) {
                return Err(invalid(format!(
                    "layer {l}: logical expert {e} has no physical slot"
                )));
            }
            logical_to_physical.push(slots);
        }
        Ok(ExpertPlacement {
            num_devices,
            num_experts,
            layers,
            logical_to_physical,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(logical: &[u32], devices: &[u32]) -> LayerPlacement {
        LayerPlacement {
            physical_to_logical: logical.iter().map(|e| ExpertId(*e)).collect(),
            physical_to_device: devices.iter().map(|d| DeviceId(*d)).collect(),
        }
    }

    fn invalid_message(result: Result<ExpertPlacement, PlacementError>) -> String {
        match result {
            Err(PlacementError::Invalid { message, .. }) => message,
            other => panic!("expected an invalid placement, got {other:?}"),
        }
    }

    #[test]
    fn round_robin_deals_slots_to_devices_and_maps_back() {
        let p = ExpertPlacement::round_robin(3, 8, 4, 0).unwrap();
        assert_eq!(p.num_layers(), 3);
        assert_eq!(p.num_physical(2), 8);
        assert_eq!(p.device_of(1, 6), DeviceId(2));
        for e in 0..8 {
            assert_eq!(p.logical_to_physical(0, ExpertId(e)), &[e as usize]);
        }
    }

    #[test]
    fn round_robin_replicas_live_away_from_their_original() {
        let p = ExpertPlacement::round_robin(1, 8, 2, 2).unwrap();
        // Slot 8 is on device 0, so it replicates expert 1 (device 1); slot 9 replicates 0.
        assert_eq!(p.physical_to_logical(0)[8..], [ExpertId(1), ExpertId(0)]);
        assert_eq!(p.logical_to_physical(0, ExpertId(0)), &[0, 9]);
        assert_eq!(p.device_of(0, 9), DeviceId(1));
        let single = ExpertPlacement::round_robin(1, 4, 1, 5).unwrap();
        assert_eq!(single.num_replicas(0, ExpertId(0)), 3);
        assert_eq!(single.num_replicas(0, ExpertId(3)), 2);
    }

    #[test]
    fn replicas_take_turns_by_token_ordinal() {
        let p = ExpertPlacement::new(2, 2, vec![layer(&[0, 1, 0], &[0, 1, 1])]).unwrap();
        let slots: Vec<usize> = (0..5).map(|i| p.slot_for(0, ExpertId(0), i)).collect();
        assert_eq!(slots, vec![0, 2, 0, 2, 0]);
        assert_eq!(p.slot_for(0, ExpertId(1), 7), 1);
    }

    #[test]
    fn json_round_trips() {
        let p = ExpertPlacement::round_robin(2, 6, 3, 3).unwrap();
        let back = ExpertPlacement::from_json_str(&p.to_json()).unwrap();
        assert_eq!(back, p);
        let embedded = serde_json::to_string(&p).unwrap();
        assert_eq!(ExpertPlacement::from_json_str(&embedded).unwrap(), p);
    }

    #[test]
    fn file_round_trips_and_a_missing_file_names_its_path() {
        let path = std::env::temp_dir().join(format!("placement-{}.json", std::process::id()));
        let p = ExpertPlacement::round_robin(2, 4, 2, 2).unwrap();
        p.write_json_file(&path).unwrap();
        assert_eq!(ExpertPlacement::from_json_file(&path).unwrap(), p);
        std::fs::remove_file(&path).unwrap();
        let err = ExpertPlacement::from_json_file(&path).unwrap_err();
        assert!(err.to_string().contains(&path.display().to_string()));
    }

    #[test]
    fn expert_without_a_slot_is_named() {
        let message = invalid_message(ExpertPlacement::new(1, 3, vec![layer(&[0, 2], &[0, 0])]));
        assert_eq!(message, "layer 0: logical expert 1 has no physical slot");
    }

    #[test]
    fn device_out_of_range_is_named_with_its_slot() {
        let layers = vec![layer(&[0, 1], &[0, 0]), layer(&[0, 1], &[0, 2])];
        let message = invalid_message(ExpertPlacement::new(2, 2, layers));
        assert!(
            message.starts_with("layer 1, slot 1: device 2"),
            "{message}"
        );
    }

    #[test]
    fn mismatched_lengths_and_unknown_experts_are_rejected() {
        let message = invalid_message(ExpertPlacement::new(1, 2, vec![layer(&[0, 1], &[0])]));
        assert!(message.contains("physical_to_device has 1"), "{message}");
        let message = invalid_message(ExpertPlacement::new(1, 2, vec![layer(&[0, 5], &[0, 0])]));
        assert!(message.contains("expert 5 is out of range"), "{message}");
        let message = invalid_message(ExpertPlacement::new(0, 2, vec![]));
        assert!(message.contains("num_devices (0)"), "{message}");
    }

    #[test]
    fn malformed_json_is_a_json_error_and_unknown_fields_are_refused() {
        let err = ExpertPlacement::from_json_str("{\"num_devices\": 1").unwrap_err();
        assert!(matches!(err, PlacementError::Json { .. }));
        let err = ExpertPlacement::from_json_str(
            r#"{"num_devices": 1, "num_experts": 1, "layers": [], "extra": 1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("extra"), "{err}");
    }

    #[test]
    fn json_from_the_docs_parses() {
        let p = ExpertPlacement::from_json_str(
            r#"{ "num_devices": 2, "num_experts": 4,
                 "layers": [ { "physical_to_logical": [0, 1, 2, 3, 0],
                               "physical_to_device":  [0, 1, 0, 1, 1] } ] }"#,
        )
        .unwrap();
        assert_eq!(p.logical_to_physical(0, ExpertId(0)), &[0, 4]);
        assert_eq!(p.device_of(0, 4), DeviceId(1));
    }
}
