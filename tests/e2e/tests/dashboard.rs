//! `GET /dashboard` in a real headless Chromium (WebDriver): the page polls the real server and
//! its DOM shows what `GET /v1/moe/load` says — a layers × experts heatmap whose cells hold the
//! windowed pairs of each expert, replicas marked, one bar per device, the counters — and the
//! heatmap changes when the load moves to other experts. The demo model (8 experts × 30 layers)
//! serves skewed prompts (one token repeated, so a few experts take most pairs) on two device
//! workers with redundant slots and re-placement. A screenshot is saved under
//! `target/e2e-artifacts/` (and copied to `$MOESERVE_DOCS_SCREENSHOT` when set: that is how the
//! README's `docs/dashboard.png` is made). The other tests: the page's API-key flow, and the
//! heatmap at 64 experts × 48 layers (the `mixtral-wide` preset) on a laptop-sized window.

use std::process::{Command, Stdio};
use std::time::Duration;

use futures_util::future::join_all;
use moeserve_e2e::{
    Browser, Server, client, demo_model_dir, engine_idle, moeserve_bin, repo_root, scrape_until,
    send, tiny_model, tiny_model_path,
};
use serde_json::{Value, json};

const PAGE_TIMEOUT: Duration = Duration::from_secs(60);

/// `count` requests whose prompt repeats `token`, `concurrency` at a time.
async fn skewed_load(server: &Server, token: u32, count: usize, concurrency: usize) {
    let url = server.url("/v1/completions");
    let body = json!({"prompt": vec![token; 24], "max_tokens": 16, "ignore_eos": true,
                      "temperature": 0});
    for _ in 0..count.div_ceil(concurrency) {
        let batch = (0..concurrency).map(|_| send(client().post(&url).json(&body)));
        for r in join_all(batch).await {
            assert_eq!(r.status, 200, "{}", r.body);
        }
    }
}

async fn moe_load(server: &Server) -> Value {
    let r = send(client().get(server.url("/v1/moe/load"))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

/// Waits until nothing runs, then returns the (now fixed) load report.
async fn settled_load(server: &Server) -> Value {
    let samples = scrape_until(&server.url("/metrics"), engine_idle).await;
    assert!(engine_idle(&samples), "the engine did not go idle");
    moe_load(server).await
}

/// Waits until the page shows engine step `steps`, i.e. it rendered the settled report.
async fn wait_page_at_step(browser: &Browser, steps: u64) {
    let script = format!("return document.getElementById('steps').dataset.steps === '{steps}';");
    browser
        .wait_for(
            &format!("the page to show step {steps}"),
            &script,
            PAGE_TIMEOUT,
        )
        .await;
}

/// The heatmap as the page shows it: `[layer][expert]` → (pairs, share, replicas).
async fn page_heatmap(browser: &Browser) -> Vec<Vec<(u64, f64, u64)>> {
    let cells = browser
        .execute(
            "const hm = document.getElementById('heatmap');
             return { layers: Number(hm.dataset.layers), experts: Number(hm.dataset.experts),
                      cells: [...hm.querySelectorAll('.cell')].map((c) => [
                        Number(c.dataset.layer), Number(c.dataset.expert), Number(c.dataset.pairs),
                        Number(c.dataset.share), Number(c.dataset.replicas)]) };",
            json!([]),
        )
        .await;
    let (layers, experts) = (
        cells["layers"].as_u64().unwrap() as usize,
        cells["experts"].as_u64().unwrap() as usize,
    );
    let list = cells["cells"].as_array().expect("cells");
    assert_eq!(list.len(), layers * experts, "one cell per (layer, expert)");
    let mut grid = vec![vec![None; experts]; layers];
    for c in list {
        let n = |i: usize| c[i].as_f64().expect("numeric data attribute");
        let slot = &mut grid[n(0) as usize][n(1) as usize];
        assert!(
            slot.is_none(),
            "two cells for layer {} expert {}",
            n(0),
            n(1)
        );
        *slot = Some((n(2) as u64, n(3), n(4) as u64));
    }
    grid.into_iter()
        .map(|row| row.into_iter().map(|c| c.expect("every cell")).collect())
        .collect()
}

/// The page's heatmap must hold exactly the report's windowed loads, shares and replicas.
fn assert_heatmap_matches(page: &[Vec<(u64, f64, u64)>], load: &Value) {
    let layers = load["layers"].as_array().unwrap();
    assert_eq!(page.len(), layers.len());
    assert_eq!(page[0].len() as u64, load["num_experts"].as_u64().unwrap());
    let placement = &load["placement"]["layers"];
    for (l, (row, layer)) in page.iter().zip(layers).enumerate() {
        let window: Vec<u64> = layer["windowed_load"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let total: u64 = window.iter().sum();
        assert!(total > 0, "layer {l} has no load in the window");
        let copies = placement[l]["physical_to_logical"].as_array().unwrap();
        for (e, &(pairs, share, replicas)) in row.iter().enumerate() {
            assert_eq!(pairs, window[e], "layer {l} expert {e}");
            assert!((share - window[e] as f64 / total as f64).abs() < 1e-5);
            let expected = copies
                .iter()
                .filter(|x| x.as_u64() == Some(e as u64))
                .count();
            assert_eq!(
                replicas, expected as u64,
                "replicas of layer {l} expert {e}"
            );
        }
        let sum: f64 = row.iter().map(|c| c.1).sum();
        assert!((sum - 1.0).abs() < 1e-4, "layer {l} shares sum to {sum}");
    }
}

async fn text_of(browser: &Browser, id: &str) -> String {
    let script = format!("return document.getElementById('{id}').textContent;");
    let value = browser.execute(&script, json!([])).await;
    value.as_str().expect("text").to_string()
}

/// Saves a screenshot under target/e2e-artifacts/.
fn save_artifact(name: &str, png: &[u8]) {
    let dir = repo_root().join("target/e2e-artifacts");
    std::fs::create_dir_all(&dir).expect("artifact dir");
    std::fs::write(dir.join(name), png).expect("write the screenshot");
}

/// Width and height from a PNG's IHDR chunk.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

#[tokio::test]
async fn the_dashboard_shows_live_expert_load_in_chromium() {
    let model = demo_model_dir();
    let server = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--served-model-name",
        "smolmoe-8x135m",
        "--kv-cache-memory",
        "32MiB",
        // 32 MiB hold 720 tokens of the demo model: the longest request must fit.
        "--max-model-len",
        "512",
        "--expert-parallel-size",
        "2",
        "--num-redundant-experts",
        "2",
        "--load-window",
        "16",
        "--rebalance-interval",
        "16",
        "--rebalance-threshold",
        "1.05",
        "--capacity-factor",
        "1.5",
    ])
    .await;
    let browser = Browser::start(1440, 900).await;
    browser.goto(&server.url("/dashboard")).await;
    browser
        .wait_for(
            "the first update",
            "return document.getElementById('status').dataset.state === 'live' \
             && Number(document.body.dataset.updates) > 0;",
            PAGE_TIMEOUT,
        )
        .await;

    // Load on the experts that token 1234 picks; the page must show exactly that window.
    skewed_load(&server, 1234, 8, 4).await;
    let first = settled_load(&server).await;
    wait_page_at_step(&browser, first["num_steps"].as_u64().unwrap()).await;
    let before = page_heatmap(&browser).await;
    assert_eq!(before.len(), 30, "the demo model has 30 MoE layers");
    assert_heatmap_matches(&before, &first);
    assert!(
        before.iter().flatten().any(|c| c.2 > 1),
        "redundant slots hold replicas, which the heatmap marks"
    );

    // Devices and counters.
    let devices = browser
        .execute(
            "return [...document.querySelectorAll('#devices [data-device]')]
               .map((b) => [Number(b.dataset.device), Number(b.dataset.tokens)]);",
            json!([]),
        )
        .await;
    let expected: Vec<Value> = first["devices"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(d, dev)| json!([d, dev["tokens"]]))
        .collect();
    assert_eq!(devices, Value::Array(expected), "one bar per device");
    let pairs: u64 = first["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["pairs"].as_u64().unwrap())
        .sum();
    let shown = browser
        .execute(
            "return Number(document.getElementById('pairs-rate').dataset.total);",
            json!([]),
        )
        .await;
    assert_eq!(shown.as_u64(), Some(pairs));
    assert_eq!(text_of(&browser, "num-running").await, "0");
    assert_eq!(text_of(&browser, "num-waiting").await, "0");
    assert!(text_of(&browser, "kv-usage").await.ends_with('%'));
    for id in ["ttft-p95", "tpot-p95"] {
        let text = text_of(&browser, id).await;
        assert!(
            text.ends_with(" ms") || text.ends_with(" s"),
            "{id}: {text}"
        );
    }
    assert!(text_of(&browser, "model").await.contains("smolmoe-8x135m"));

    // Shift the load to the experts of another token: the page follows.
    skewed_load(&server, 4321, 8, 4).await;
    let second = settled_load(&server).await;
    wait_page_at_step(&browser, second["num_steps"].as_u64().unwrap()).await;
    let after = page_heatmap(&browser).await;
    assert_heatmap_matches(&after, &second);
    let moved_layers = before
        .iter()
        .zip(&after)
        .filter(|(a, b)| a.iter().zip(*b).any(|(x, y)| (x.1 - y.1).abs() > 0.05))
        .count();
    assert!(
        moved_layers >= before.len() / 2,
        "the heatmap barely changed when the load moved: {moved_layers} of {} layers",
        before.len()
    );

    // Under concurrent load the live counters move; the screenshot is taken then.
    let load = skewed_load(&server, 777, 48, 8);
    let watch = async {
        browser
            .wait_for(
                "running requests on the page",
                "return Number(document.getElementById('num-running').dataset.value) > 0;",
                PAGE_TIMEOUT,
            )
            .await;
        tokio::time::sleep(Duration::from_secs(4)).await;
        // The whole page: grow the window by what the viewport lacks (the window's own
        // frame takes some of its height).
        for _ in 0..2 {
            let size = browser
                .execute(
                    "return [window.outerHeight, window.innerHeight,
                             document.documentElement.scrollHeight];",
                    json!([]),
                )
                .await;
            let [outer, inner, page] = [0, 1, 2].map(|i| size[i].as_u64().expect("size") as u32);
            browser
                .set_window_size(1440, (outer + page - inner).clamp(600, 2400))
                .await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        browser.screenshot().await
    };
    let ((), png) = tokio::join!(load, watch);
    let (width, height) = png_size(&png);
    assert!(
        width >= 1200 && height >= 600,
        "screenshot {width}×{height}"
    );
    save_artifact("dashboard.png", &png);
    if let Some(docs) = std::env::var_os("MOESERVE_DOCS_SCREENSHOT") {
        std::fs::write(&docs, &png).expect("write the docs screenshot");
    }
    let rates = browser
        .execute(
            "return [...document.querySelectorAll('#devices [data-device]')]
               .map((b) => Number(b.dataset.rate));",
            json!([]),
        )
        .await;
    assert!(
        rates
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r.as_f64() > Some(0.0)),
        "device bars show the load: {rates}"
    );
}

#[tokio::test]
async fn the_dashboard_asks_for_the_api_key_and_sends_it_as_bearer() {
    const KEY: &str = "sk-dashboard-Key-42";
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&["--model", path.to_str().unwrap(), "--api-key", KEY]).await;
    // The page shell carries no data; every JSON endpoint it reads needs the key.
    let shell = client().get(server.url("/dashboard")).send().await.unwrap();
    assert_eq!(shell.status(), 200);
    for path in ["/v1/stats", "/v1/moe/load"] {
        assert_eq!(send(client().get(server.url(path))).await.status, 401);
        let with_key = send(client().get(server.url(path)).bearer_auth(KEY)).await;
        assert_eq!(with_key.status, 200, "{}", with_key.body);
    }

    let browser = Browser::start(1280, 800).await;
    browser.goto(&server.url("/dashboard")).await;
    browser
        .wait_for(
            "the key prompt",
            "return document.getElementById('status').dataset.state === 'unauthorized' \
             && document.getElementById('key-panel').dataset.open === 'true';",
            PAGE_TIMEOUT,
        )
        .await;
    let cells = "return document.querySelectorAll('#heatmap .cell').length;";
    assert_eq!(
        browser.execute(cells, json!([])).await,
        0,
        "no data without the key"
    );

    // A wrong key is refused; the right one brings the data.
    let submit = "document.getElementById('key-input').value = arguments[0];
                  document.getElementById('key-form').requestSubmit();";
    browser.execute(submit, json!(["sk-wrong"])).await;
    browser
        .wait_for(
            "the refusal",
            "return document.getElementById('status').textContent === 'API key refused';",
            PAGE_TIMEOUT,
        )
        .await;
    browser.execute(submit, json!([KEY])).await;
    let live = "return document.getElementById('status').dataset.state === 'live' \
                && document.querySelectorAll('#heatmap .cell').length;";
    let num_cells = browser
        .wait_for("data with the key", live, PAGE_TIMEOUT)
        .await;
    let load = send(client().get(server.url("/v1/moe/load")).bearer_auth(KEY)).await;
    let expected =
        load.body["num_layers"].as_u64().unwrap() * load.body["num_experts"].as_u64().unwrap();
    assert_eq!(num_cells.as_u64(), Some(expected));

    // The key in the URL fragment works too, and is removed from the address bar.
    browser.execute("sessionStorage.clear();", json!([])).await;
    // A new document (a fragment-only change would not reload the page).
    browser.goto("about:blank").await;
    browser
        .goto(&format!("{}#key={KEY}", server.url("/dashboard")))
        .await;
    browser
        .wait_for("data with the fragment key", live, PAGE_TIMEOUT)
        .await;
    let href = browser.execute("return location.href;", json!([])).await;
    assert!(!href.as_str().unwrap().contains(KEY), "{href}");
}

#[tokio::test]
async fn the_heatmap_fits_64_experts_by_48_layers_on_a_laptop_screen() {
    let dir = tempfile::Builder::new()
        .prefix("moeserve-e2e-")
        .tempdir()
        .expect("temp dir");
    let model = dir.path().join("wide");
    let status = Command::new(moeserve_bin())
        .args(["make-model", "--preset", "mixtral-wide", "--out"])
        .arg(&model)
        .stderr(Stdio::null())
        .status()
        .expect("run moeserve make-model");
    assert!(status.success(), "moeserve make-model failed: {status}");
    let server = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--expert-parallel-size",
        "4",
        "--num-redundant-experts",
        "8",
        "--load-window",
        "64",
    ])
    .await;
    let url = server.url("/v1/completions");
    for prompt in [
        "Experts at scale",
        "sixty-four of them",
        "in forty-eight layers",
    ] {
        let body = json!({"prompt": prompt, "max_tokens": 16, "ignore_eos": true});
        let r = send(client().post(&url).json(&body)).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let load = settled_load(&server).await;
    assert_eq!(
        (load["num_layers"].as_u64(), load["num_experts"].as_u64()),
        (Some(48), Some(64))
    );

    let browser = Browser::start(1440, 900).await;
    browser.goto(&server.url("/dashboard")).await;
    wait_page_at_step(&browser, load["num_steps"].as_u64().unwrap()).await;
    let page = page_heatmap(&browser).await;
    assert_heatmap_matches(&page, &load);
    // Readable on a laptop screen: no horizontal scrolling, cells big enough to see and hover.
    let layout = browser
        .execute(
            "const cell = document.querySelector('#heatmap .cell').getBoundingClientRect();
             const map = document.getElementById('heatmap').getBoundingClientRect();
             return { overflow: document.documentElement.scrollWidth - window.innerWidth,
                      cell: [cell.width, cell.height], right: map.right, width: window.innerWidth };",
            json!([]),
        )
        .await;
    assert!(layout["overflow"].as_f64() <= Some(0.0), "{layout}");
    assert!(layout["cell"][0].as_f64() >= Some(6.0), "{layout}");
    assert!(layout["cell"][1].as_f64() >= Some(8.0), "{layout}");
    assert!(
        layout["right"].as_f64() <= layout["width"].as_f64(),
        "{layout}"
    );
    let png = browser.screenshot().await;
    assert_eq!(png_size(&png).0, 1440);
    save_artifact("dashboard-64x48.png", &png);
}
