//! `--config FILE` end to end: the file's settings apply, and flags override them.

use std::time::Duration;

use moeserve_e2e::{Server, client, send, tiny_model, tiny_model_path};

#[tokio::test]
async fn the_config_file_applies_and_flags_override_it() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let config = model.path().join("serve.toml");
    let toml = format!(
        "model = {:?}\nserved_model_name = \"from-file\"\nmax_model_len = 512\n\
         max_num_seqs = 4\nmetrics_compat = \"vllm\"\n",
        path.to_str().unwrap()
    );
    std::fs::write(&config, toml).unwrap();
    let server = Server::start(&["--config", config.to_str().unwrap()]).await;
    let models = send(client().get(server.url("/v1/models"))).await;
    assert_eq!(models.body["data"][0]["id"], "from-file");
    assert_eq!(models.body["data"][0]["max_model_len"], 512);
    assert!(
        server.log_shows("max model len 512", Duration::from_secs(10)),
        "{}",
        server.logs()
    );
    drop(server);

    let server = Server::start(&[
        "--config",
        config.to_str().unwrap(),
        "--served-model-name",
        "from-flag",
        "--max-model-len",
        "256",
    ])
    .await;
    let models = send(client().get(server.url("/v1/models"))).await;
    assert_eq!(models.body["data"][0]["id"], "from-flag");
    assert_eq!(models.body["data"][0]["max_model_len"], 256);
}

/// `--print-config` prints the effective settings as a config file; served from that file, the
/// server runs with the same settings, and printing it again gives the same text.
#[tokio::test]
async fn print_config_writes_a_file_that_serves_the_same_settings() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let config = model.path().join("serve.toml");
    std::fs::write(&config, "max_num_seqs = 3\nmax_model_len = 384\n").unwrap();
    let print = |args: &[&str]| {
        let mut argv = vec!["serve", "--print-config"];
        argv.extend(args);
        let out = moeserve_e2e::run_with_output(&argv, Duration::from_secs(30));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let config_arg = config.to_str().unwrap();
    let printed = print(&[
        "--config",
        config_arg,
        "--model",
        path.to_str().unwrap(),
        "--served-model-name",
        "p",
        "--threads",
        "1",
    ]);
    for line in [
        "max_num_seqs = 3\n",
        "max_model_len = 384\n",
        "threads = 1\n",
    ] {
        assert!(printed.contains(line), "{line:?} in\n{printed}");
    }
    let again = model.path().join("printed.toml");
    std::fs::write(&again, &printed).unwrap();
    let again_arg = again.to_str().unwrap();
    assert_eq!(print(&["--config", again_arg]), printed);
    // `host` and `port` in the file are overridden by the harness's flags.
    let server = Server::start(&["--config", again_arg]).await;
    let models = send(client().get(server.url("/v1/models"))).await;
    assert_eq!(models.body["data"][0]["id"], "p");
    assert_eq!(models.body["data"][0]["max_model_len"], 384);
}

/// `--generation-config auto` (the default) takes the model's sampling defaults from its
/// generation_config.json and says so at start-up; `vllm` ignores them.
#[tokio::test]
async fn the_models_generation_config_sets_the_sampling_defaults() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let gen_path = path.join("generation_config.json");
    let mut gen_config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&gen_path).unwrap()).unwrap();
    gen_config["temperature"] = 0.0.into();
    gen_config["top_k"] = 5.into();
    gen_config["max_new_tokens"] = 3.into();
    std::fs::write(&gen_path, gen_config.to_string()).unwrap();
    let body = serde_json::json!({"prompt": [5, 6, 7], "ignore_eos": true, "logprobs": 0});
    let explicit = serde_json::json!({
        "prompt": [5, 6, 7], "ignore_eos": true, "temperature": 0, "max_tokens": 3
    });

    let server = Server::start(&["--model", path.to_str().unwrap()]).await;
    assert!(
        server.log_shows(
            "sampling defaults from the model's generation_config.json: temperature=0, \
             top_k=5, max_tokens=3",
            Duration::from_secs(10)
        ),
        "{}",
        server.logs()
    );
    let url = server.url("/v1/completions");
    let first = moeserve_e2e::post_json(&url, &body).await;
    let second = moeserve_e2e::post_json(&url, &body).await;
    let greedy = moeserve_e2e::post_json(&url, &explicit).await;
    // Greedy (temperature 0 from the file) and capped at max_new_tokens (not OpenAI's 16).
    assert_eq!(
        first.body["usage"]["completion_tokens"], 3,
        "{}",
        first.body
    );
    assert_eq!(
        first.body["choices"][0]["text"],
        second.body["choices"][0]["text"]
    );
    assert_eq!(
        first.body["choices"][0]["text"],
        greedy.body["choices"][0]["text"]
    );
    drop(server);

    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--generation-config",
        "vllm",
    ])
    .await;
    assert!(
        server.log_shows("sampling defaults: vLLM's", Duration::from_secs(10)),
        "{}",
        server.logs()
    );
    let plain = moeserve_e2e::post_json(&server.url("/v1/completions"), &body).await;
    assert_eq!(
        plain.body["usage"]["completion_tokens"], 16,
        "{}",
        plain.body
    );
}
