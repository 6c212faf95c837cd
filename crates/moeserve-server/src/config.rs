//! `moeserve serve` settings: the resolved [`ServeConfig`] after flags override the `--config`
//! file (`config_file`), and the value types of its flags.

use std::path::{Path, PathBuf};
use std::time::Duration;

use moeserve_core::DType;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_model::config::ModelConfig;

use crate::auth::ApiKey;

/// `--dtype`: the compute dtype. Only the checkpoint's own dtype is supported for now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeChoice {
    /// The checkpoint's dtype.
    #[default]
    Auto,
    Bfloat16,
    Float16,
    Float32,
}

impl DtypeChoice {
    fn dtype(self) -> Option<DType> {
        match self {
            DtypeChoice::Auto => None,
            DtypeChoice::Bfloat16 => Some(DType::BF16),
            DtypeChoice::Float16 => Some(DType::F16),
            DtypeChoice::Float32 => Some(DType::F32),
        }
    }

    /// Refuses a dtype other than the checkpoint's: weights are not converted (yet).
    pub fn check(self, model: &ModelConfig, config_path: &Path) -> Result<(), String> {
        let Some(wanted) = self.dtype() else {
            return Ok(());
        };
        match model.dtype {
            Some(stored) if stored == wanted => Ok(()),
            Some(stored) => Err(format!(
                "--dtype {wanted}: the checkpoint is {stored} ({}), and converting weights to \
                 another dtype is not supported yet; use --dtype auto or {stored}",
                config_path.display()
            )),
            None => Err(format!(
                "--dtype {wanted}: {} declares no dtype, so it cannot be checked; converting \
                 weights is not supported yet, use --dtype auto",
                config_path.display()
            )),
        }
    }
}

/// `--metrics-compat`: also export every series under another project's names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricsCompat {
    /// Only the `moeserve:` names.
    #[default]
    None,
    /// Also the `vllm:` names (and the deprecated `vllm:gpu_cache_usage_perc`).
    Vllm,
}

/// `--generation-config`: where requests' sampling defaults come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GenerationConfigMode {
    /// The model's `generation_config.json` (temperature, top_p, top_k, min_p,
    /// repetition_penalty, max_new_tokens), as vLLM's default.
    #[default]
    Auto,
    /// vLLM's own defaults; the model's file is ignored.
    Vllm,
}

/// Everything `serve` needs, resolved and checked.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The model directory, or a hub id until `cli::model_source` resolves it.
    pub model: PathBuf,
    /// `--revision` and `--download-dir` of a hub id.
    pub revision: String,
    pub download_dir: Option<PathBuf>,
    pub host: String,
    pub port: u16,
    pub served_model_name: String,
    pub api_key: Option<ApiKey>,
    pub dtype: DtypeChoice,
    pub max_request_bytes: usize,
    pub max_waiting_requests: usize,
    pub metrics_compat: MetricsCompat,
    pub generation_config: GenerationConfigMode,
    /// How `tool_choice: "auto"` replies are parsed for calls; `None`: "auto" is refused.
    pub auto_tool_parser: Option<crate::openai::tools::ToolCallParser>,
    /// `/metrics` needs the API key too.
    pub metrics_auth: bool,
    /// `--allowed-hosts` / `--allowed-origins` (or their defaults for the bind address).
    pub origin_policy: crate::origin::OriginPolicy,
    pub limits: ServerLimits,
    pub engine: EngineConfig,
}

/// Connection and time limits of the HTTP layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ServerLimits {
    /// Open connections beyond this wait in the kernel's accept queue.
    pub max_connections: usize,
    /// Largest request head (request line and headers); 431 beyond.
    pub max_header_bytes: usize,
    /// The request head and body must arrive within this.
    pub request_read_timeout: Duration,
    /// A generation request is cancelled with 504 after this; `None`: no limit.
    pub request_timeout: Option<Duration>,
    /// After SIGTERM / Ctrl-C, requests in flight get this long before they are cancelled.
    pub shutdown_timeout: Duration,
}

impl ServerLimits {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".to_string());
        }
        if self.max_header_bytes < 1024 {
            return Err(format!(
                "--max-header-bytes must be at least 1KiB, got {} bytes",
                self.max_header_bytes
            ));
        }
        Ok(())
    }
}

/// Parses a positive number of seconds, like `30` or `0.5`.
pub fn parse_seconds(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .trim()
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    seconds_to_duration(seconds)
}

/// A positive, finite number of seconds as a [`Duration`].
pub fn seconds_to_duration(seconds: f64) -> Result<Duration, String> {
    if !(seconds.is_finite() && seconds > 0.0 && seconds < 1e9) {
        return Err(format!("{seconds} is not a positive number of seconds"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// The default served name: the model directory's name (`.` and `..` resolved first).
pub fn default_served_model_name(model: &Path) -> String {
    let name = |path: &Path| path.file_name().map(|n| n.to_string_lossy().into_owned());
    name(model)
        .or_else(|| model.canonicalize().ok().as_deref().and_then(name))
        .unwrap_or_else(|| model.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_name_defaults_to_the_directory_name() {
        assert_eq!(
            default_served_model_name(Path::new("models/smolmoe-8x135m/")),
            "smolmoe-8x135m"
        );
        assert_eq!(default_served_model_name(Path::new("/tmp/x")), "x");
        let here = std::env::current_dir().unwrap();
        assert_eq!(
            default_served_model_name(Path::new(".")),
            here.file_name().unwrap().to_string_lossy()
        );
    }

    #[test]
    fn a_dtype_other_than_the_checkpoints_is_refused() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mixtral-swa");
        let model = ModelConfig::from_dir(&dir).unwrap();
        let path = dir.join("config.json");
        assert!(DtypeChoice::Auto.check(&model, &path).is_ok());
        assert!(DtypeChoice::Bfloat16.check(&model, &path).is_ok());
        let err = DtypeChoice::Float32.check(&model, &path).unwrap_err();
        assert!(err.contains("not supported yet"), "{err}");
    }
}
