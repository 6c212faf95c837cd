//! Routing traces (`--record-routing FILE`): per step and MoE layer, the experts the router
//! chose for each token (its top-k before capacity), one JSON object per line, for offline
//! analysis and the capacity-factor tuner:
//!
//! ```json
//! {"step":0,"layer":0,"num_tokens":2,"experts":[[3,1],[0,3]]}
//! ```

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Lines, Write};
use std::path::Path;

use moeserve_model::moe::RoutedStep;
use serde::{Deserialize, Serialize};

use crate::{EngineError, Result};

/// One line of a routing trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingTraceRecord {
    pub step: u64,
    pub layer: usize,
    pub num_tokens: usize,
    /// `[num_tokens][top_k]`: expert ids, best first.
    pub experts: Vec<Vec<u32>>,
}

/// The same line, borrowing the router's output instead of copying it.
#[derive(Serialize)]
struct RecordRef<'a> {
    step: u64,
    layer: usize,
    num_tokens: usize,
    experts: Vec<&'a [u32]>,
}

fn trace_error(origin: &str, message: impl std::fmt::Display) -> EngineError {
    EngineError::RoutingTrace {
        path: origin.to_string(),
        message: message.to_string(),
    }
}

/// Appends trace lines to a file (or any writer).
pub struct RoutingTraceWriter<W: Write> {
    out: W,
    /// Named in errors.
    origin: String,
}

impl RoutingTraceWriter<BufWriter<File>> {
    /// Creates (truncates) `path`.
    pub fn create(path: &Path) -> Result<Self> {
        let origin = path.display().to_string();
        let file = File::create(path).map_err(|e| trace_error(&origin, e))?;
        Ok(Self::new(BufWriter::new(file), origin))
    }
}

impl<W: Write> RoutingTraceWriter<W> {
    /// `origin` names the destination in errors.
    pub fn new(out: W, origin: impl Into<String>) -> Self {
        RoutingTraceWriter {
            out,
            origin: origin.into(),
        }
    }

    /// Writes the router's choice of one layer's step (`RoutedStep::chosen_experts`).
    pub fn write_routed(&mut self, step: u64, layer: usize, routed: &RoutedStep) -> Result<()> {
        let record = RecordRef {
            step,
            layer,
            num_tokens: routed.num_tokens,
            experts: routed.chosen_by_token().collect(),
        };
        self.write_line(&record)
    }

    pub fn write_record(&mut self, record: &RoutingTraceRecord) -> Result<()> {
        self.write_line(record)
    }

    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| trace_error(&self.origin, e))
    }

    /// The underlying writer (flushes nothing).
    pub fn into_inner(self) -> W {
        self.out
    }

    fn write_line(&mut self, record: &impl Serialize) -> Result<()> {
        serde_json::to_writer(&mut self.out, record).map_err(|e| trace_error(&self.origin, e))?;
        self.out
            .write_all(b"\n")
            .map_err(|e| trace_error(&self.origin, e))
    }
}

/// Reads trace lines back, in order; blank lines are skipped.
pub struct RoutingTraceReader<R: BufRead> {
    lines: Lines<R>,
    origin: String,
    line: usize,
}

impl RoutingTraceReader<BufReader<File>> {
    pub fn open(path: &Path) -> Result<Self> {
        let origin = path.display().to_string();
        let file = File::open(path).map_err(|e| trace_error(&origin, e))?;
        Ok(Self::new(BufReader::new(file), origin))
    }
}

impl<R: BufRead> RoutingTraceReader<R> {
    /// `origin` names the source in errors.
    pub fn new(input: R, origin: impl Into<String>) -> Self {
        RoutingTraceReader {
            lines: input.lines(),
            origin: origin.into(),
            line: 0,
        }
    }

    fn parse(&self, text: &str) -> Result<RoutingTraceRecord> {
        let at =
            |message: String| trace_error(&self.origin, format!("line {}: {message}", self.line));
        let record: RoutingTraceRecord =
            serde_json::from_str(text).map_err(|e| at(e.to_string()))?;
        if record.experts.len() != record.num_tokens {
            return Err(at(format!(
                "num_tokens is {} but {} tokens have experts",
                record.num_tokens,
                record.experts.len()
            )));
        }
        Ok(record)
    }
}

impl<R: BufRead> Iterator for RoutingTraceReader<R> {
    type Item = Result<RoutingTraceRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.line += 1;
            let text = match self.lines.next()? {
                Ok(text) => text,
                Err(e) => return Some(Err(trace_error(&self.origin, e))),
            };
            if !text.trim().is_empty() {
                return Some(self.parse(&text));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeserve_model::moe::{RouterConfig, route};

    fn record(step: u64, layer: usize, experts: Vec<Vec<u32>>) -> RoutingTraceRecord {
        RoutingTraceRecord {
            step,
            layer,
            num_tokens: experts.len(),
            experts,
        }
    }

    #[test]
    fn routed_steps_are_written_as_one_json_line_each() {
        let routed = route(
            &[0.0, 1.0, 3.0, 2.0, 5.0, 0.0, 1.0, 4.0],
            4,
            &RouterConfig::dropless(2),
        );
        let mut w = RoutingTraceWriter::new(Vec::new(), "memory");
        w.write_routed(7, 1, &routed).unwrap();
        let text = String::from_utf8(w.into_inner()).unwrap();
        assert_eq!(
            text,
            "{\"step\":7,\"layer\":1,\"num_tokens\":2,\"experts\":[[2,3],[0,3]]}\n"
        );
    }

    #[test]
    fn records_round_trip_through_a_file() {
        let path = std::env::temp_dir().join(format!("routing-{}.jsonl", std::process::id()));
        let records = vec![
            record(0, 0, vec![vec![1, 0], vec![3, 2]]),
            record(0, 1, vec![vec![2, 1], vec![0, 1]]),
            record(1, 0, vec![]),
        ];
        let mut w = RoutingTraceWriter::create(&path).unwrap();
        records.iter().for_each(|r| w.write_record(r).unwrap());
        w.flush().unwrap();
        let back: Vec<_> = RoutingTraceReader::open(&path)
            .unwrap()
            .collect::<Result<_>>()
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(back, records);
    }

    #[test]
    fn blank_lines_are_skipped_and_bad_lines_are_named() {
        let input = "\n{\"step\":0,\"layer\":0,\"num_tokens\":1,\"experts\":[[4]]}\n\nnot json\n";
        let mut r = RoutingTraceReader::new(input.as_bytes(), "trace.jsonl");
        assert_eq!(r.next().unwrap().unwrap(), record(0, 0, vec![vec![4]]));
        let err = r.next().unwrap().unwrap_err().to_string();
        assert!(
            err.starts_with("routing trace trace.jsonl: line 4:"),
            "{err}"
        );
        assert!(r.next().is_none());
    }

    #[test]
    fn token_count_must_match_the_experts() {
        let input = "{\"step\":0,\"layer\":0,\"num_tokens\":2,\"experts\":[[4]]}";
        let err = RoutingTraceReader::new(input.as_bytes(), "t")
            .next()
            .unwrap()
            .unwrap_err();
        assert!(
            err.to_string().contains("num_tokens is 2 but 1 tokens"),
            "{err}"
        );
    }

    #[test]
    fn missing_file_names_its_path() {
        let path = Path::new("/nonexistent/routing.jsonl");
        let err = RoutingTraceReader::open(path).err().unwrap().to_string();
        assert!(err.contains("/nonexistent/routing.jsonl"), "{err}");
    }
}
