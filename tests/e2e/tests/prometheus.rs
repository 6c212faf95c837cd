//! The monitoring configs with the real tools: `promtool` accepts configs/prometheus/ (config,
//! alert rules and the rules' unit tests); a real Prometheus, started on the committed
//! prometheus.yml with only its target (and scrape interval) rewritten, scrapes a real server
//! and answers MoE queries with the values `/metrics` shows, with every alert rule loaded; and
//! every query of the Grafana dashboard (configs/grafana/moeserve.json) names series the server
//! exports and evaluates in that Prometheus.

use std::collections::BTreeSet;

use moeserve_e2e::{
    Prometheus, Sample, Server, engine_idle, post_json, promtool, repo_root, scrape, scrape_until,
    tiny_model, tiny_model_path,
};
use serde_json::{Value, json};

fn read_config(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn promtool_accepts_the_config_the_rules_and_their_tests() {
    let dir = repo_root().join("configs/prometheus");
    let config = promtool(&dir, &["check", "config", "prometheus.yml"]);
    assert!(config.contains("SUCCESS: 1 rule files found"), "{config}");
    let rules = promtool(&dir, &["check", "rules", "alerts.yml"]);
    assert!(rules.contains("SUCCESS: 7 rules found"), "{rules}");
    let tests = promtool(&dir, &["test", "rules", "alerts.test.yml"]);
    assert!(tests.contains("SUCCESS"), "{tests}");
}

/// The committed config with its target pointed at `address` and a 1 s scrape interval, so the
/// test need not wait for the default 5 s.
fn config_for(address: &str) -> String {
    let text = read_config("configs/prometheus/prometheus.yml");
    let rewritten = text
        .replacen("\"localhost:8000\"", &format!("\"{address}\""), 1)
        .replacen("scrape_interval: 5s", "scrape_interval: 1s", 1)
        .replacen("evaluation_interval: 5s", "evaluation_interval: 1s", 1);
    assert_eq!(
        rewritten.matches(address).count(),
        1,
        "configs/prometheus/prometheus.yml no longer targets \"localhost:8000\" once"
    );
    assert!(rewritten.contains("scrape_interval: 1s"));
    rewritten
}

/// Every `moeserve:` metric name in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.match_indices("moeserve:")
        .map(|(at, _)| {
            expr[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect()
        })
        .collect()
}

/// Every PromQL expression of the Grafana dashboard: panel targets and variable queries.
fn grafana_exprs(dashboard: &Value) -> Vec<String> {
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(target["expr"].as_str().expect("target expr").to_string());
        }
    }
    for var in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if var["type"] == "query" {
            exprs.push(var["query"]["query"].as_str().expect("query").to_string());
        }
    }
    exprs
}

/// A Grafana expression as Prometheus takes it: variables at "All", `label_values(s, l)` as
/// `count by (l) (s)`.
fn as_promql(expr: &str) -> String {
    let expr = expr
        .replace("$model_name", ".*")
        .replace("$instance", ".*")
        .replace("$layer", ".*")
        .replace("$__rate_interval", "15s");
    match expr
        .strip_prefix("label_values(")
        .and_then(|e| e.strip_suffix(')'))
    {
        Some(args) => {
            let (selector, label) = args
                .rsplit_once(',')
                .expect("label_values(selector, label)");
            format!("count by ({}) ({selector})", label.trim())
        }
        None => expr,
    }
}

fn sample_value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
        })
        .map(|s| s.value)
}

#[tokio::test]
async fn prometheus_scrapes_moe_series_and_answers_every_grafana_query() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    // Two devices with spare slots and eager re-placement, so every MoE series (the
    // re-placement gain too) exists; a capacity factor, so drops are counted.
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--served-model-name",
        "tiny-moe",
        "--expert-parallel-size",
        "2",
        "--num-redundant-experts",
        "2",
        "--load-window",
        "8",
        "--rebalance-interval",
        "8",
        "--rebalance-threshold",
        "1.01",
        "--capacity-factor",
        "1.0",
    ])
    .await;
    // Skewed load (a prompt repeating one token) until the engine has re-placed its experts
    // once (a few rounds; bounded).
    let url = server.url("/v1/completions");
    let metrics = server.url("/metrics");
    let mut samples = Vec::new();
    for round in 0..80 {
        let token = 40 + round % 2;
        let body = json!({"prompt": vec![token; 16], "max_tokens": 12, "ignore_eos": true});
        let r = post_json(&url, &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        if round >= 8 && round % 4 == 3 {
            samples = scrape_until(&metrics, engine_idle).await;
            if sample_value(&samples, "moeserve:moe_rebalances_total", &[]) >= Some(1.0) {
                break;
            }
        }
    }
    assert!(
        sample_value(&samples, "moeserve:moe_rebalances_total", &[]) >= Some(1.0),
        "no re-placement happened: step imbalance {:?}",
        sample_value(&samples, "moeserve:moe_step_imbalance", &[])
    );

    let address = server.url("").trim_start_matches("http://").to_string();
    let prometheus = Prometheus::start(&[
        ("prometheus.yml", config_for(&address)),
        ("alerts.yml", read_config("configs/prometheus/alerts.yml")),
    ])
    .await;

    // The scrape succeeds and carries the per-expert counter, one series per (layer, expert).
    prometheus
        .query_until(r#"up{job="moeserve"}"#, |r| {
            r.first().is_some_and(|s| s["value"][1] == "1")
        })
        .await;
    let num_cells = samples
        .iter()
        .filter(|s| s.name == "moeserve:moe_expert_tokens_total")
        .count();
    assert_eq!(num_cells, 2 * 8, "mixtral-tiny: 2 layers × 8 experts");
    let series = prometheus
        .query_until(
            r#"moeserve:moe_expert_tokens_total{job="moeserve", model_name="tiny-moe"}"#,
            |r| r.len() == num_cells,
        )
        .await;
    // The engine is idle, so Prometheus holds exactly what /metrics shows.
    let now = scrape(&metrics).await;
    for s in &series {
        let (layer, expert) = (
            s["metric"]["layer"].as_str().expect("layer label"),
            s["metric"]["expert"].as_str().expect("expert label"),
        );
        let value: f64 = s["value"][1].as_str().unwrap().parse().unwrap();
        let expected = sample_value(
            &now,
            "moeserve:moe_expert_tokens_total",
            &[("layer", layer), ("expert", expert)],
        );
        assert_eq!(Some(value), expected, "layer {layer} expert {expert}");
    }
    let total: f64 = prometheus
        .query(r#"sum(moeserve:moe_expert_tokens_total{job="moeserve"})"#)
        .await[0]["value"][1]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(total > 0.0);

    // The alert rules are loaded from the committed file and evaluate without errors.
    let rules = prometheus.api("rules", &[]).await;
    let groups = rules["groups"].as_array().expect("rule groups");
    assert_eq!(groups.len(), 1, "{rules}");
    let loaded = groups[0]["rules"].as_array().unwrap();
    assert_eq!(loaded.len(), 7, "{rules}");
    for rule in loaded {
        assert_eq!(rule["health"], "ok", "{rule}");
    }

    // Every Grafana query: its series exist on /metrics, and Prometheus evaluates it. Wait for
    // a few scrapes first, so rates over 15 s have two samples.
    prometheus
        .query_until(r#"count_over_time(up{job="moeserve"}[15s])"#, |r| {
            r.first()
                .and_then(|s| s["value"][1].as_str()?.parse::<f64>().ok())
                .is_some_and(|n| n >= 3.0)
        })
        .await;
    let exported: BTreeSet<&str> = now.iter().map(|s| s.name.as_str()).collect();
    let dashboard: Value =
        serde_json::from_str(&read_config("configs/grafana/moeserve.json")).expect("JSON");
    let exprs = grafana_exprs(&dashboard);
    assert!(exprs.len() > 20, "{} queries", exprs.len());
    let mut used = BTreeSet::new();
    for expr in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "no moeserve series in `{expr}`");
        for name in names {
            assert!(
                exported.contains(name.as_str()),
                "`{name}` is not on /metrics"
            );
            used.insert(name);
        }
        let result = prometheus.query(&as_promql(expr)).await;
        assert!(!result.is_empty(), "`{expr}` has no data");
    }
    for name in [
        "moeserve:moe_expert_tokens_total",
        "moeserve:moe_load_imbalance",
        "moeserve:moe_dropped_pairs_total",
        "moeserve:num_requests_waiting",
        "moeserve:kv_cache_usage_perc",
        "moeserve:time_to_first_token_seconds_bucket",
    ] {
        assert!(used.contains(name), "the dashboard has no panel on {name}");
    }
    let datasource_ok = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["type"] == "row" || p["datasource"]["uid"] == "${datasource}");
    assert!(datasource_ok, "every panel reads the `datasource` variable");
    let panels = dashboard["panels"].as_array().unwrap();
    let ids: BTreeSet<u64> = panels.iter().map(|p| p["id"].as_u64().unwrap()).collect();
    assert_eq!(ids.len(), panels.len(), "panel ids are unique");
    for p in panels {
        let grid = &p["gridPos"];
        let right = grid["x"].as_u64().unwrap() + grid["w"].as_u64().unwrap();
        assert!(
            right <= 24 && grid["h"].as_u64() > Some(0),
            "{}",
            p["title"]
        );
    }
    assert_eq!(dashboard["uid"], "moeserve");
}
