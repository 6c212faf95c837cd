//! `moeserve serve`: the OpenAI-compatible HTTP server. Flags are named as vLLM's; `--config`
//! reads every one of them from a TOML file (`config_file`), and flags given explicitly (or
//! through their environment variable) override the file, which overrides the defaults.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, FromArgMatches};

use super::engine_args::{EngineArgs, parse_size};
use super::model_source;
use crate::auth::ApiKey;
use crate::config::{
    DtypeChoice, GenerationConfigMode, MetricsCompat, ServeConfig, ServerLimits,
    default_served_model_name, parse_seconds,
};
use crate::config_file;
use crate::logging::{LogFormat, LogLevel};
use crate::openai::tools::ToolCallParser;
use crate::origin::{Allowed, OriginPolicy};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Model directory in Hugging Face format, or a hub id (`org/name`) found in the Hugging
    /// Face cache or downloaded into it (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN,
    /// HF_ENDPOINT are read as huggingface_hub reads them).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The branch, tag or commit of a hub model.
    #[arg(long, default_value = "main")]
    revision: String,
    /// The Hugging Face cache to look in and download to (default: HF_HUB_CACHE, else
    /// HF_HOME/hub, else ~/.cache/huggingface/hub).
    #[arg(long)]
    download_dir: Option<PathBuf>,
    /// A TOML file with any of these settings (snake_case keys); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print the effective settings (flags over --config file over defaults) as TOML and exit.
    #[arg(long)]
    print_config: bool,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port; the bound address is printed as `listening on http://ADDR`.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients send and see (default: the hub id, or the model directory's
    /// name).
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
    /// Log level: error, warn, info, debug or trace (default: `RUST_LOG` if set, a `tracing`
    /// filter such as `info,moeserve_engine=debug`, else info).
    #[arg(long, value_enum)]
    log_level: Option<LogLevel>,
    /// Log lines as text or as JSON objects (one per line, with the request id).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(flatten)]
    engine: EngineArgs,
}

/// `serve`'s own command, to parse the merged flags and file with.
pub fn command() -> clap::Command {
    ServeArgs::augment_args(clap::Command::new("serve"))
}

/// The serve matches with the `--config` file's keys filled in under the flags given
/// explicitly (on the command line or through their environment variable).
pub fn with_config_file(cmd: &clap::Command, matches: &ArgMatches) -> anyhow::Result<ArgMatches> {
    let Some(path) = matches.get_one::<PathBuf>("config") else {
        return Ok(matches.clone());
    };
    let given = |id: &str| {
        matches!(
            matches.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    };
    let mut argv = vec![OsString::from("serve")];
    argv.extend(config_file::file_args(cmd, path, given).map_err(anyhow::Error::msg)?);
    argv.extend(config_file::command_line_args(cmd, matches));
    Ok(cmd.clone().try_get_matches_from(argv)?)
}

/// Checks the settings and resolves what depends on several of them.
pub fn resolve(args: ServeArgs) -> anyhow::Result<ServeConfig> {
    let limits = ServerLimits {
        max_connections: args.max_connections,
        max_header_bytes: usize::try_from(args.max_header_bytes)
            .context("--max-header-bytes is too large")?,
        request_read_timeout: args.request_read_timeout,
        request_timeout: args.request_timeout,
        shutdown_timeout: args.shutdown_timeout,
    };
    limits.validate().map_err(anyhow::Error::msg)?;
    let model = args
        .model
        .context("give --model DIR (or `model` in the --config file)")?;
    let engine = args.engine.to_config(Default::default());
    engine.cache.validate().context("invalid cache settings")?;
    engine
        .scheduler
        .validate()
        .context("invalid scheduler settings")?;
    let served_model_name = args.served_model_name.unwrap_or_else(|| {
        let text = model.to_string_lossy();
        match !model.is_dir() && model_source::is_hub_id(&text) {
            true => text.into_owned(),
            false => default_served_model_name(&model),
        }
    });
    let api_key = match args.api_key {
        None => None,
        Some(raw) => {
            let (key, trimmed) = ApiKey::from_secret(&raw)
                .map_err(|why| anyhow::anyhow!("invalid API key (--api-key): {why}"))?;
            if trimmed {
                tracing::warn!("--api-key: removed the key's trailing newline");
            }
            Some(key)
        }
    };
    if args.metrics_auth && api_key.is_none() {
        anyhow::bail!("--metrics-auth needs an API key (--api-key or MOESERVE_API_KEY)");
    }
    // Settings that could only fail every request are refused, not served.
    if args.max_waiting_requests == 0 {
        anyhow::bail!(
            "--max-waiting-requests 0 would answer every request 429: it must be at least 1"
        );
    }
    if args.max_request_bytes == 0 {
        anyhow::bail!("--max-request-bytes 0 would refuse every body: it must be at least 1");
    }
    let auto_tool_parser = match (args.enable_auto_tool_choice, args.tool_call_parser) {
        (true, None) => anyhow::bail!("--enable-auto-tool-choice needs --tool-call-parser"),
        (true, parser) => parser,
        (false, _) => None,
    };
    let mut origin_policy = OriginPolicy::defaults_for(&args.host);
    if let Some(hosts) = &args.allowed_hosts {
        origin_policy.hosts = Allowed::parse(hosts);
    }
    if let Some(origins) = &args.allowed_origins {
        origin_policy.origins = Some(Allowed::parse(origins));
    }
    Ok(ServeConfig {
        host: args.host,
        origin_policy,
        port: args.port,
        api_key,
        dtype: args.dtype,
        max_request_bytes: usize::try_from(args.max_request_bytes)
            .context("--max-request-bytes is too large")?,
        max_waiting_requests: args.max_waiting_requests,
        metrics_compat: args.metrics_compat,
        auto_tool_parser,
        generation_config: args.generation_config,
        metrics_auth: args.metrics_auth,
        limits,
        served_model_name,
        model,
        revision: args.revision,
        download_dir: args.download_dir,
        engine,
    })
}

pub fn run(matches: &ArgMatches) -> anyhow::Result<()> {
    let cmd = command();
    let matches = with_config_file(&cmd, matches)?;
    let args = ServeArgs::from_arg_matches(&matches)?;
    if args.print_config {
        print!("{}", config_file::print(&cmd, &matches, &["api_key"]));
        return Ok(());
    }
    crate::logging::init(args.log_level, args.log_format);
    let request = args.engine.device;
    let engine_args = args.engine.clone();
    let mut config = resolve(args)?;
    let device = super::device::select(request)?;
    // A hub id becomes its snapshot directory in the cache (downloaded if need be).
    config.model = model_source::resolve(
        &config.model,
        &config.revision,
        config.download_dir.as_deref(),
    )?
    .dir;
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
    use std::io::Write;

    /// The effective matches of `argv` (a config file merged in).
    fn matches_of(argv: &[&str]) -> anyhow::Result<ArgMatches> {
        let cmd = command();
        let matches = cmd.clone().try_get_matches_from(argv)?;
        with_config_file(&cmd, &matches)
    }

    fn resolve_args(argv: &[&str]) -> anyhow::Result<ServeConfig> {
        resolve(ServeArgs::from_arg_matches(&matches_of(argv)?)?)
    }

    fn printed(argv: &[&str]) -> String {
        config_file::print(&command(), &matches_of(argv).unwrap(), &["api_key"])
    }

    fn temp_config(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let file = temp_config(
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
        let file = temp_config(
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
        let file = temp_config("kv_cache_memory = \"lots\"");
        let path = file.path().to_str().unwrap();
        let err = resolve_args(&["x", "--model", "m", "--config", path]).unwrap_err();
        assert!(err.to_string().contains("kv_cache_memory"), "{err}");
    }

    /// A value for each flag that differs from its default, so that a key the file dropped
    /// would show; a new flag must be added here (the test says which).
    fn sample_value(id: &str) -> Option<&'static str> {
        Some(match id {
            "model" => "/models/m",
            "revision" => "v2",
            "download_dir" => "/tmp/hub",
            "host" => "0.0.0.0",
            "port" => "9001",
            "served_model_name" => "m2",
            "allowed_hosts" => "a.example,b.example",
            "allowed_origins" => "https://a.example",
            "api_key" => "sk-test",
            "dtype" => "bfloat16",
            "max_request_bytes" => "2MiB",
            "max_waiting_requests" => "7",
            "metrics_compat" => "vllm",
            "generation_config" => "vllm",
            "tool_call_parser" => "hermes",
            "max_connections" => "9",
            "max_header_bytes" => "64KiB",
            "request_read_timeout" => "3",
            "request_timeout" => "4.5",
            "shutdown_timeout" => "6",
            "max_num_seqs" => "5",
            "max_num_batched_tokens" => "512",
            "block_size" => "32",
            "kv_cache_memory" => "256MiB",
            "kv_cache_dtype" => "bfloat16",
            "gpu_memory_utilization" => "0.5",
            "max_model_len" => "1024",
            "device" => "cpu",
            "threads" => "1",
            "quantization" => "int8",
            "capacity_factor" => "1.5",
            "moe_overflow" => "reroute",
            "expert_parallel_size" => "2",
            "num_redundant_experts" => "1",
            "expert_placement" => "/tmp/placement.json",
            "load_window" => "10",
            "rebalance_threshold" => "1.5",
            "rebalance_interval" => "20",
            "rebalance_min_gain" => "0.1",
            "expert_copy_bytes_per_second" => "1000000",
            "record_routing" => "/tmp/routing.jsonl",
            "expert_metrics" => "off",
            "log_level" => "debug",
            "log_format" => "json",
            _ => return None,
        })
    }

    #[test]
    fn every_serve_flag_has_its_key_in_the_config_file() {
        let cmd = command();
        let mut checked = 0;
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            let long = arg.get_long().unwrap_or(id);
            if arg.is_hide_set() || ["config", "print_config", "help"].contains(&id) {
                continue;
            }
            // A switch is written as `key = true`, or `key = false` for an on-by-default one.
            let (flag_argv, file_line) = if matches!(arg.get_action(), clap::ArgAction::SetTrue) {
                match cmd
                    .get_arguments()
                    .find(|a| a.get_id() == format!("no_{id}").as_str())
                {
                    Some(no) => (
                        vec![format!("--{}", no.get_long().unwrap())],
                        format!("{id} = false"),
                    ),
                    None => (vec![format!("--{long}")], format!("{id} = true")),
                }
            } else {
                let value = sample_value(id)
                    .unwrap_or_else(|| panic!("flag --{long}: add a sample value to this test"));
                (
                    vec![format!("--{long}"), value.to_string()],
                    format!("{id} = {value:?}"),
                )
            };
            // --metrics-auth needs a key, auto tool choice a parser: give all three around
            // each flag but itself.
            let base: Vec<&str> = [
                ("model", "/m0"),
                ("api-key", "k"),
                ("tool-call-parser", "mistral"),
            ]
            .into_iter()
            .filter(|(flag, _)| *flag != long)
            .flat_map(|(flag, value)| [flag, value])
            .collect();
            let base: Vec<String> = std::iter::once("x".to_string())
                .chain(
                    base.chunks(2)
                        .flat_map(|p| [format!("--{}", p[0]), p[1].to_string()]),
                )
                .collect();
            let base: Vec<&str> = base.iter().map(String::as_str).collect();
            let mut by_flag = base.clone();
            by_flag.extend(flag_argv.iter().map(String::as_str));
            let file = temp_config(&file_line);
            let mut by_file = base.clone();
            by_file.extend(["--config", file.path().to_str().unwrap()]);
            let (flag, from_file) = (printed(&by_flag), printed(&by_file));
            assert_eq!(flag, from_file, "--{long} against `{file_line}`");
            let resolved =
                resolve_args(&by_file).unwrap_or_else(|e| panic!("`{file_line}`: {e:#}"));
            if id == "api_key" {
                // Never printed: seen in the resolved settings instead.
                assert!(
                    resolved.api_key.is_some() && resolve_args(&base).unwrap().api_key.is_none()
                );
            } else {
                assert_ne!(printed(&base), flag, "--{long} changed nothing");
            }
            checked += 1;
        }
        assert!(checked >= 40, "checked {checked} flags");
    }

    #[test]
    fn print_config_round_trips_through_the_config_file() {
        let file = temp_config("max_num_seqs = 8\n[moe]\ncapacity_factor = 1.25\n");
        let path = file.path().to_str().unwrap();
        let argv = [
            "x",
            "--config",
            path,
            "--model",
            "/m",
            "--port",
            "0",
            "--no-enable-prefix-caching",
            "--kv-cache-memory",
            "1GiB",
            "--request-timeout",
            "2.5",
            "--metrics-auth",
            "--api-key",
            "secret-key",
        ];
        let first = printed(&argv);
        assert!(!first.contains("secret-key"), "{first}");
        assert!(first.contains("max_num_seqs = 8\n"), "{first}");
        assert!(first.contains("capacity_factor = 1.25\n"), "{first}");
        assert!(first.contains("enable_prefix_caching = false\n"), "{first}");
        let again = temp_config(&first);
        // The key is given again (it is never printed).
        let second = printed(&[
            "x",
            "--config",
            again.path().to_str().unwrap(),
            "--api-key",
            "secret-key",
        ]);
        assert_eq!(first, second);
        // And the defaults alone round-trip too.
        let defaults = printed(&["x"]);
        let file = temp_config(&defaults);
        assert_eq!(
            defaults,
            printed(&["x", "--config", file.path().to_str().unwrap()])
        );
    }

    #[test]
    fn a_bad_value_in_the_file_names_the_file_and_the_key() {
        let file = temp_config("max_num_seqs = \"many\"");
        let path = file.path().to_str().unwrap();
        let err = resolve_args(&["x", "--config", path])
            .unwrap_err()
            .to_string();
        assert!(err.contains(path) && err.contains("max_num_seqs"), "{err}");
        let file = temp_config("[moe]\nport = 1");
        let err = resolve_args(&["x", "--config", file.path().to_str().unwrap()]).unwrap_err();
        assert!(err.to_string().contains("not a MoE setting"), "{err}");
        let file = temp_config("capacity_factor = 1.5\n[moe]\ncapacity_factor = 2.0");
        let err = resolve_args(&["x", "--config", file.path().to_str().unwrap()]).unwrap_err();
        assert!(err.to_string().contains("set twice"), "{err}");
    }
}
