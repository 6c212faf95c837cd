//! `moeserve serve`: the OpenAI-compatible HTTP server. Flags are named as vLLM's; `--config`
//! reads the same keys from a TOML file, and flags given explicitly (or through their environment
//! variable) override the file, which overrides the defaults.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use moeserve_core::{CacheConfig, SchedulerConfig};
use moeserve_engine::engine_core::EngineConfig;

use super::engine_args::{EngineArgs, parse_size};
use crate::auth::ApiKey;
use crate::config::{
    DtypeChoice, GenerationConfigMode, MetricsCompat, ServeConfig, ServeFile, ServerLimits,
    SizeValue, default_served_model_name, parse_seconds, seconds_to_duration,
};
use crate::openai::tools::ToolCallParser;
use crate::origin::{Allowed, OriginPolicy};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Model directory in Hugging Face format (or `model` in the config file).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A TOML file with any of these settings (snake_case keys); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port; the bound address is printed as `listening on http://ADDR`.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients send and see (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Host names requests may carry in `Host`, comma-separated, or `*` (default: localhost,
    /// 127.0.0.1 and [::1] when bound to loopback, which stops DNS rebinding; any otherwise).
    #[arg(long)]
    allowed_hosts: Option<String>,
    /// Browser origins allowed to call the API (CORS), comma-separated `scheme://host[:port]`,
    /// or `*` (default: origins on an allowed host).
    #[arg(long)]
    allowed_origins: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1/* (a trailing newline is removed). Read as
    /// text and checked after parsing, so that no error message can echo the key.
    #[arg(long, env = "MOESERVE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Compute dtype; anything but the checkpoint's own dtype is refused for now.
    #[arg(long, value_enum, default_value_t = DtypeChoice::Auto)]
    dtype: DtypeChoice,
    /// Largest request body, e.g. 1MiB.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    max_request_bytes: u64,
    /// Requests waiting for their first token beyond this get 429 with Retry-After.
    #[arg(long, default_value_t = 1024)]
    max_waiting_requests: usize,
    /// Also export metrics under vLLM's names, so vLLM dashboards work unchanged.
    #[arg(long, value_enum, default_value_t = MetricsCompat::None)]
    metrics_compat: MetricsCompat,
    /// Sampling defaults of requests that leave them out: `auto` takes the model's
    /// generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
    /// max_new_tokens), `vllm` ignores it.
    #[arg(long, value_enum, default_value_t = GenerationConfigMode::Auto)]
    generation_config: GenerationConfigMode,
    /// How calls are read out of a reply under `tool_choice: "auto"`: `hermes` (Qwen),
    /// `mistral` (Mixtral), `deepseek_v3` (DeepSeek-V3 / R1 / V3.1), `glm45` (GLM-4.5) or
    /// `openai` (GPT-OSS's harmony calls).
    #[arg(long, value_enum)]
    tool_call_parser: Option<ToolCallParser>,
    /// Let the model decide whether to call a tool (`tool_choice: "auto"`, the default when
    /// `tools` are given); needs --tool-call-parser.
    #[arg(long)]
    enable_auto_tool_choice: bool,
    /// Require the API key on /metrics too (needs --api-key).
    #[arg(long)]
    metrics_auth: bool,
    /// Most open client connections; more wait in the kernel's accept queue.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Largest request head (request line and headers), e.g. 32KiB; larger gets 431.
    #[arg(long, default_value = "32KiB", value_parser = parse_size)]
    max_header_bytes: u64,
    /// Seconds a client has to send the request head and body (then: closed, or 408).
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    request_read_timeout: Duration,
    /// Seconds a generation request may take in all before it is cancelled with 504
    /// (default: no limit).
    #[arg(long, value_parser = parse_seconds)]
    request_timeout: Option<Duration>,
    /// Seconds in-flight requests get to finish after SIGTERM / Ctrl-C before they are
    /// cancelled (meanwhile new requests and /health get 503).
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    shutdown_timeout: Duration,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Which settings were given on the command line (or their environment variable).
struct Explicit<'a>(&'a ArgMatches);

impl Explicit<'_> {
    fn given(&self, id: &str) -> bool {
        matches!(
            self.0.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    }

    /// The flag's value when given, else the file's, else the flag's default.
    fn pick<T>(&self, id: &str, flag: T, file: Option<T>) -> T {
        match (self.given(id), file) {
            (false, Some(from_file)) => from_file,
            _ => flag,
        }
    }

    /// Like [`Explicit::pick`] for flags without a default.
    fn pick_opt<T>(&self, id: &str, flag: Option<T>, file: Option<T>) -> Option<T> {
        match self.given(id) {
            true => flag,
            false => file.or(flag),
        }
    }

    /// A `--flag` / `--no-flag` pair whose default is on.
    fn pick_switch(&self, id: &str, no_flag: bool, file: Option<bool>) -> bool {
        let given = self.given(id) || self.given(&format!("no_{id}"));
        match (given, file) {
            (false, Some(from_file)) => from_file,
            _ => !no_flag,
        }
    }
}

fn size(value: Option<SizeValue>, key: &str) -> anyhow::Result<Option<u64>> {
    value
        .map(|v| v.bytes())
        .transpose()
        .map_err(|e| anyhow::anyhow!("config file `{key}`: {e}"))
}

fn seconds(value: Option<f64>, key: &str) -> anyhow::Result<Option<Duration>> {
    value
        .map(seconds_to_duration)
        .transpose()
        .map_err(|e| anyhow::anyhow!("config file `{key}`: {e}"))
}

/// The connection and time limits: flags over the file over the defaults.
fn resolve_limits(
    args: &ServeArgs,
    file: &ServeFile,
    x: &Explicit,
) -> anyhow::Result<ServerLimits> {
    let max_header_bytes = x.pick(
        "max_header_bytes",
        args.max_header_bytes,
        size(file.max_header_bytes.clone(), "max_header_bytes")?,
    );
    let limits = ServerLimits {
        max_connections: x.pick(
            "max_connections",
            args.max_connections,
            file.max_connections,
        ),
        max_header_bytes: usize::try_from(max_header_bytes)
            .context("--max-header-bytes is too large")?,
        request_read_timeout: x.pick(
            "request_read_timeout",
            args.request_read_timeout,
            seconds(file.request_read_timeout, "request_read_timeout")?,
        ),
        request_timeout: x.pick_opt(
            "request_timeout",
            args.request_timeout,
            seconds(file.request_timeout, "request_timeout")?,
        ),
        shutdown_timeout: x.pick(
            "shutdown_timeout",
            args.shutdown_timeout,
            seconds(file.shutdown_timeout, "shutdown_timeout")?,
        ),
    };
    limits.validate().map_err(anyhow::Error::msg)?;
    Ok(limits)
}

/// Merges flags over the config file over the defaults.
pub fn resolve(args: ServeArgs, matches: &ArgMatches) -> anyhow::Result<ServeConfig> {
    let file = match &args.config {
        Some(path) => ServeFile::load(path).map_err(anyhow::Error::msg)?,
        None => ServeFile::default(),
    };
    let x = Explicit(matches);
    let limits = resolve_limits(&args, &file, &x)?;
    let model = x
        .pick_opt("model", args.model, file.model)
        .context("give --model DIR (or `model` in the --config file)")?;
    let e = &args.engine;
    let engine = EngineConfig {
        cache: CacheConfig {
            block_size: x.pick("block_size", e.block_size, file.block_size),
            kv_cache_memory: x.pick_opt(
                "kv_cache_memory",
                e.kv_cache_memory,
                size(file.kv_cache_memory, "kv_cache_memory")?,
            ),
            enable_prefix_caching: x.pick_switch(
                "enable_prefix_caching",
                e.no_enable_prefix_caching,
                file.enable_prefix_caching,
            ),
            gpu_memory_utilization: e.gpu_memory_utilization,
        },
        scheduler: SchedulerConfig {
            max_num_seqs: x.pick("max_num_seqs", e.max_num_seqs, file.max_num_seqs),
            max_num_batched_tokens: x.pick(
                "max_num_batched_tokens",
                e.max_num_batched_tokens,
                file.max_num_batched_tokens,
            ),
            enable_chunked_prefill: x.pick_switch(
                "enable_chunked_prefill",
                e.no_enable_chunked_prefill,
                file.enable_chunked_prefill,
            ),
            max_model_len: x.pick_opt("max_model_len", e.max_model_len, file.max_model_len),
        },
        moe: e.moe.apply(file.moe.clone().unwrap_or_default(), |id| {
            file.moe.is_none() || x.given(id)
        }),
        // Set by `run` from `--device` (resolved before anything else).
        device: Default::default(),
    };
    engine.cache.validate().context("invalid cache settings")?;
    engine
        .scheduler
        .validate()
        .context("invalid scheduler settings")?;
    let max_request_bytes = x.pick(
        "max_request_bytes",
        args.max_request_bytes,
        size(file.max_request_bytes, "max_request_bytes")?,
    );
    let served_model_name = x
        .pick_opt(
            "served_model_name",
            args.served_model_name,
            file.served_model_name,
        )
        .unwrap_or_else(|| default_served_model_name(&model));
    let api_key = match x.pick_opt("api_key", args.api_key, file.api_key) {
        None => None,
        Some(raw) => {
            let (key, trimmed) = ApiKey::from_secret(&raw)
                .map_err(|why| anyhow::anyhow!("invalid API key (--api-key): {why}"))?;
            if trimmed {
                eprintln!("moeserve: --api-key: removed the key's trailing newline");
            }
            Some(key)
        }
    };
    let metrics_auth = x.pick("metrics_auth", args.metrics_auth, file.metrics_auth);
    if metrics_auth && api_key.is_none() {
        anyhow::bail!("--metrics-auth needs an API key (--api-key or MOESERVE_API_KEY)");
    }
    let max_waiting_requests = x.pick(
        "max_waiting_requests",
        args.max_waiting_requests,
        file.max_waiting_requests,
    );
    // Settings that could only fail every request are refused, not served.
    if max_waiting_requests == 0 {
        anyhow::bail!(
            "--max-waiting-requests 0 would answer every request 429: it must be at least 1"
        );
    }
    if max_request_bytes == 0 {
        anyhow::bail!("--max-request-bytes 0 would refuse every body: it must be at least 1");
    }
    let tool_call_parser = x.pick_opt(
        "tool_call_parser",
        args.tool_call_parser,
        file.tool_call_parser,
    );
    let enable_auto_tool_choice = x.pick(
        "enable_auto_tool_choice",
        args.enable_auto_tool_choice,
        file.enable_auto_tool_choice,
    );
    let auto_tool_parser = match (enable_auto_tool_choice, tool_call_parser) {
        (true, None) => anyhow::bail!("--enable-auto-tool-choice needs --tool-call-parser"),
        (true, parser) => parser,
        (false, _) => None,
    };
    let host = x.pick("host", args.host, file.host);
    let mut origin_policy = OriginPolicy::defaults_for(&host);
    if let Some(hosts) = x.pick_opt("allowed_hosts", args.allowed_hosts, file.allowed_hosts) {
        origin_policy.hosts = Allowed::parse(&hosts);
    }
    if let Some(origins) = x.pick_opt(
        "allowed_origins",
        args.allowed_origins,
        file.allowed_origins,
    ) {
        origin_policy.origins = Some(Allowed::parse(&origins));
    }
    Ok(ServeConfig {
        host,
        origin_policy,
        port: x.pick("port", args.port, file.port),
        api_key,
        dtype: x.pick("dtype", args.dtype, file.dtype),
        max_request_bytes: usize::try_from(max_request_bytes)
            .context("--max-request-bytes is too large")?,
        max_waiting_requests,
        metrics_compat: x.pick("metrics_compat", args.metrics_compat, file.metrics_compat),
        auto_tool_parser,
        generation_config: x.pick(
            "generation_config",
            args.generation_config,
            file.generation_config,
        ),
        metrics_auth,
        limits,
        served_model_name,
        model,
        engine,
    })
}

pub fn run(args: ServeArgs, matches: &ArgMatches) -> anyhow::Result<()> {
    let request = args.engine.device;
    let engine_args = args.engine.clone();
    let mut config = resolve(args, matches)?;
    let device = super::device::select(request)?;
    engine_args.init_kernels(&config.model)?;
    config.engine.device = device;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("moeserve-http")
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(crate::server::serve(config));
    // A model still loading on a blocking thread must not hold the exit up for long.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser};
    use std::io::Write;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn resolve_args(argv: &[&str]) -> anyhow::Result<ServeConfig> {
        let matches = Wrapper::command().try_get_matches_from(argv)?;
        let wrapper = Wrapper::from_arg_matches(&matches)?;
        resolve(wrapper.serve, &matches)
    }

    fn config_file(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let file = config_file(
            "model = \"/models/a\"\nport = 9000\nmax_num_seqs = 8\nblock_size = 32\n\
             enable_prefix_caching = false\nhost = \"0.0.0.0\"\n",
        );
        let path = file.path().to_str().unwrap();
        let c =
            resolve_args(&["x", "--config", path, "--port", "0", "--max-num-seqs", "4"]).unwrap();
        assert_eq!(c.port, 0);
        assert_eq!(c.engine.scheduler.max_num_seqs, 4);
        assert_eq!(c.engine.cache.block_size, 32);
        assert!(!c.engine.cache.enable_prefix_caching);
        assert_eq!(c.host, "0.0.0.0");
        assert_eq!(c.served_model_name, "a");
        let c = resolve_args(&["x", "--config", path, "--enable-prefix-caching"]).unwrap();
        assert!(c.engine.cache.enable_prefix_caching);
    }

    #[test]
    fn settings_that_could_only_fail_are_refused_with_the_reason() {
        for (flag, says) in [
            ("--max-waiting-requests", "every request 429"),
            ("--max-request-bytes", "refuse every body"),
        ] {
            let err = resolve_args(&["x", "--model", "m", flag, "0"]).unwrap_err();
            assert!(err.to_string().contains(says), "{flag}: {err}");
        }
        let c = resolve_args(&["x", "--model", "m", "--max-waiting-requests", "1"]).unwrap();
        assert_eq!(c.max_waiting_requests, 1);
    }

    #[test]
    fn defaults_follow_vllm() {
        let c = resolve_args(&["x", "--model", "m"]).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 8000));
        assert_eq!(c.max_request_bytes, 1 << 20);
        assert!(c.engine.cache.enable_prefix_caching && c.engine.scheduler.enable_chunked_prefill);
        assert_eq!(c.metrics_compat, MetricsCompat::None);
        assert!(c.api_key.is_none());
    }

    #[test]
    fn connection_and_time_limits_come_from_flags_or_the_file() {
        let c = resolve_args(&["x", "--model", "m"]).unwrap();
        assert_eq!(c.limits.max_connections, 1024);
        assert_eq!(c.limits.max_header_bytes, 32 << 10);
        assert_eq!(c.limits.request_read_timeout, Duration::from_secs(30));
        assert_eq!(c.limits.request_timeout, None);
        assert_eq!(c.limits.shutdown_timeout, Duration::from_secs(30));
        let file = config_file(
            "request_timeout = 2.5\nshutdown_timeout = 5\nmax_connections = 8\n\
             max_header_bytes = \"16KiB\"\n",
        );
        let path = file.path().to_str().unwrap();
        let c = resolve_args(&[
            "x",
            "--model",
            "m",
            "--config",
            path,
            "--shutdown-timeout",
            "1",
        ])
        .unwrap();
        assert_eq!(c.limits.request_timeout, Some(Duration::from_millis(2500)));
        assert_eq!(c.limits.shutdown_timeout, Duration::from_secs(1));
        assert_eq!(c.limits.max_connections, 8);
        assert_eq!(c.limits.max_header_bytes, 16 << 10);
        for bad in [
            &["--request-timeout", "0"][..],
            &["--shutdown-timeout", "-1"],
            &["--request-read-timeout", "soon"],
            &["--max-connections", "0"],
            &["--max-header-bytes", "100"],
        ] {
            let argv: Vec<&str> = ["x", "--model", "m"].iter().chain(bad).copied().collect();
            assert!(resolve_args(&argv).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn metrics_auth_needs_an_api_key() {
        let err = resolve_args(&["x", "--model", "m", "--metrics-auth"]).unwrap_err();
        assert!(err.to_string().contains("--metrics-auth"), "{err}");
        let c = resolve_args(&["x", "--model", "m", "--metrics-auth", "--api-key", "k"]).unwrap();
        assert!(c.metrics_auth);
    }

    #[test]
    fn missing_model_and_bad_settings_are_reported() {
        let err = resolve_args(&["x"]).unwrap_err();
        assert!(err.to_string().contains("--model"), "{err}");
        let err = resolve_args(&["x", "--model", "m", "--block-size", "3"]).unwrap_err();
        assert!(format!("{err:#}").contains("block_size"), "{err:#}");
        let file = config_file("kv_cache_memory = \"lots\"");
        let path = file.path().to_str().unwrap();
        let err = resolve_args(&["x", "--model", "m", "--config", path]).unwrap_err();
        assert!(err.to_string().contains("kv_cache_memory"), "{err}");
    }
}
