//! `moeserve bench serve`: the serving benchmark against any OpenAI-compatible server (moeserve,
//! vLLM, llama.cpp's server), one concurrency level after another, with a progress bar; writes
//! the result JSON and the latency-versus-throughput SVG. `moeserve bench plot` draws several
//! result files on one chart. The work is done by `moeserve_bench`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use moeserve_bench::client::{Endpoint, EndpointConfig};
use moeserve_bench::dataset::{BenchPrompt, RandomPrompts, read_dataset};
use moeserve_bench::load::{LevelConfig, NumPrompts, run_level};
use moeserve_bench::plot::{Series, latency_throughput_svg};
use moeserve_bench::report::{BenchResult, BenchSetup, LevelReport, utc_now};

#[derive(Debug, Args)]
pub struct BenchServeArgs {
    /// The server's base URL, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    url: String,
    /// The model name to send (as the server lists it in /v1/models).
    #[arg(long)]
    model: String,
    /// Concurrency levels: most requests in flight, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// Requests per level: a count (64), or a multiple of the level's concurrency (4x).
    #[arg(long, default_value = "4x")]
    num_prompts: NumPrompts,
    /// Prompt tokens of random prompts (sent as token ids, so the length is exact).
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Output tokens per request (max_tokens with ignore_eos).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Poisson arrivals at this many requests per second (capped by the concurrency); default:
    /// each finished request is replaced at once.
    #[arg(long)]
    request_rate: Option<f64>,
    /// JSONL prompts ({"prompt": "text" | [ids], "max_tokens"?: n}) instead of random ones.
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// Ask for `logprobs: 1` so every token arrives as its own chunk, even one whose text is
    /// empty (random models, byte-level tokenizers); costs the server a little.
    #[arg(long)]
    stream_logprobs: bool,
    /// Bearer token for the server.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Random token ids are drawn below this.
    #[arg(long, default_value_t = 32000)]
    vocab_size: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Bound on one request, seconds.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// Write the result JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the latency-versus-throughput SVG here.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchPlotArgs {
    /// Result files of `bench serve`; each becomes a series, labelled `LABEL=FILE` or by its
    /// file name.
    #[arg(required = true)]
    results: Vec<String>,
    /// The SVG to write.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(args: BenchServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.concurrency.iter().all(|c| *c > 0),
        "--concurrency levels must be at least 1"
    );
    if let Some(rate) = args.request_rate {
        anyhow::ensure!(
            rate > 0.0 && rate.is_finite(),
            "--request-rate must be above 0"
        );
    }
    let endpoint = Endpoint::new(&EndpointConfig {
        url: &args.url,
        model: &args.model,
        api_key: args.api_key.as_deref(),
        request_timeout: Duration::from_secs(args.request_timeout),
        stream_logprobs: args.stream_logprobs,
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // One request first, as vLLM's benchmark does: a wrong URL, model or key fails here, once.
    let probe = prompts(&args, 1, usize::MAX)?;
    runtime
        .block_on(endpoint.run(&probe[0], std::time::Instant::now()))
        .map_err(|e| anyhow::anyhow!("the test request to {} failed: {e}", endpoint.url()))?;
    let mut levels = Vec::new();
    for (i, &concurrency) in args.concurrency.iter().enumerate() {
        let prompts = prompts(&args, args.num_prompts.for_concurrency(concurrency), i)?;
        let config = LevelConfig {
            concurrency,
            request_rate: args.request_rate,
            seed: args.seed.wrapping_add(i as u64),
        };
        let progress = progress_bar(prompts.len(), concurrency);
        let outcome = runtime.block_on(run_level(&endpoint, &prompts, config, &progress));
        progress.finish_and_clear();
        let level = LevelReport::new(&config, &outcome);
        tracing::info!(
            "concurrency {concurrency}: {}/{} ok in {:.1} s, {:.1} output tok/s, TPOT p50 {:.1} ms, TTFT p50 {:.0} ms",
            level.completed,
            level.num_requests,
            level.duration_s,
            level.output_throughput,
            level.tpot_ms.p50,
            level.ttft_ms.p50
        );
        levels.push(level);
    }
    let result = BenchResult {
        tool: format!("moeserve bench serve {}", env!("CARGO_PKG_VERSION")),
        date: utc_now(),
        setup: setup(&args, endpoint.url(), &levels),
        levels,
    };
    print!("{}", result.table());
    if let Some(path) = &args.out {
        result.save(path)?;
    }
    if let Some(path) = &args.plot {
        let series = [Series {
            label: args.model.clone(),
            result: &result,
        }];
        std::fs::write(path, latency_throughput_svg(&series))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed: usize = result.levels.iter().map(|l| l.failed).sum();
    if failed > 0 {
        let first = result.levels.iter().flat_map(|l| &l.errors).next();
        anyhow::bail!(
            "{failed} requests failed (first: {})",
            first.map_or("?", String::as_str)
        );
    }
    Ok(())
}

pub fn plot(args: BenchPlotArgs) -> anyhow::Result<()> {
    let mut loaded = Vec::new();
    for spec in &args.results {
        let (label, file) = match spec.split_once('=') {
            Some((label, file)) => (label.to_string(), PathBuf::from(file)),
            None => {
                let file = PathBuf::from(spec);
                let stem = file
                    .file_stem()
                    .map_or(spec.clone(), |s| s.to_string_lossy().into_owned());
                (stem, file)
            }
        };
        loaded.push((label, BenchResult::load(&file)?));
    }
    let series: Vec<Series> = loaded
        .iter()
        .map(|(label, result)| Series {
            label: label.clone(),
            result,
        })
        .collect();
    std::fs::write(&args.out, latency_throughput_svg(&series))
        .with_context(|| format!("writing {}", args.out.display()))
}

/// The prompts of level `level` (random ones differ per level, so no level reuses another's
/// prefix cache).
fn prompts(args: &BenchServeArgs, n: usize, level: usize) -> anyhow::Result<Vec<BenchPrompt>> {
    Ok(match &args.dataset {
        Some(path) => read_dataset(path, n, args.output_len)?,
        None => RandomPrompts {
            num_prompts: n,
            prompt_len: args.prompt_len,
            output_len: args.output_len,
            vocab_size: args.vocab_size,
            seed: args.seed.wrapping_mul(1000).wrapping_add(level as u64),
        }
        .generate()?,
    })
}

/// What ran; prompt and output lengths are the measured means when the server reported usage.
fn setup(args: &BenchServeArgs, url: &str, levels: &[LevelReport]) -> BenchSetup {
    let completed: usize = levels.iter().map(|l| l.completed).sum();
    let mean = |total: usize, asked: usize| {
        if completed > 0 && total > 0 {
            total as f64 / completed as f64
        } else {
            asked as f64
        }
    };
    BenchSetup {
        url: url.to_string(),
        model: args.model.clone(),
        dataset: args
            .dataset
            .as_ref()
            .map_or("random".into(), |p| p.display().to_string()),
        prompt_len: mean(
            levels.iter().map(|l| l.total_input_tokens).sum(),
            args.prompt_len,
        ),
        output_len: mean(
            levels.iter().map(|l| l.total_output_tokens).sum(),
            args.output_len,
        ),
        request_rate: args.request_rate,
        seed: args.seed,
    }
}

fn progress_bar(len: usize, concurrency: usize) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} requests {elapsed}")
            .expect("the template is valid")
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("concurrency {concurrency:>3}"));
    bar
}
