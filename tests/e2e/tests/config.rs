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
