//! The commands the README and docs/ show stay true to the binary: in every `sh` block, each
//! `moeserve ...` line names subcommands and flags that exist (synopses with `[--flag VALUE]`,
//! `a|b` and placeholders like `DIR` included), a line with no placeholders parses with clap as
//! written, and each script a line runs (`scripts/…`, `bench/…`, `models/…`) exists.

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use moeserve_server::cli::Cli;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn doc_files() -> Vec<PathBuf> {
    let mut files = vec![repo_root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo_root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The command lines of the `sh` blocks, `\` continuations joined, comments dropped.
fn shell_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("```") {
            in_sh = !in_sh && trimmed == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = match trimmed.find(" #") {
            Some(at) if !trimmed[..at].contains('\'') => &trimmed[..at],
            _ => trimmed,
        };
        if code.starts_with('#') || code.is_empty() {
            continue;
        }
        match code.strip_suffix('\\') {
            Some(head) => pending.push_str(head),
            None => {
                pending.push_str(code);
                lines.push(std::mem::take(&mut pending));
            }
        }
    }
    lines
}

/// Words of a shell line, with '…' and "…" quoting.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if any || !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                any = false;
            }
            (None, c) => word.push(c),
        }
    }
    if any || !word.is_empty() {
        words.push(word);
    }
    words
}

/// `DIR`, `N`, `FILE.toml`, `DIR-int8`, `ORG/NAME`: upper case before any `.`, `-` or `/`.
fn is_placeholder(word: &str) -> bool {
    let head = word.split(['.', '-', '/', ',']).next().unwrap_or("");
    head.chars().any(|c| c.is_ascii_uppercase()) && !head.chars().any(|c| c.is_ascii_lowercase())
}

#[test]
fn every_documented_command_matches_the_binary() {
    let mut checked = 0;
    let mut parsed = 0;
    for file in doc_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file
            .strip_prefix(repo_root())
            .unwrap_or(&file)
            .display()
            .to_string();
        for line in shell_lines(&text) {
            let mut argv = words(&line);
            // Leading `VAR=value` assignments, and a pipe or redirection after the command.
            while argv
                .first()
                .is_some_and(|w| w.contains('=') && !w.starts_with('-'))
            {
                argv.remove(0);
            }
            if let Some(end) = argv
                .iter()
                .position(|w| matches!(w.as_str(), "|" | ">" | "&&" | ">>"))
            {
                argv.truncate(end);
            }
            let Some(first) = argv.first().cloned() else {
                continue;
            };
            if ["scripts/", "bench/", "models/"]
                .iter()
                .any(|p| first.starts_with(p))
            {
                assert!(
                    repo_root().join(&first).is_file(),
                    "{name}: `{line}` runs {first}, which does not exist"
                );
                checked += 1;
                continue;
            }
            if first != "moeserve" {
                continue;
            }
            let mut cmd = Cli::command();
            let mut rest = &argv[1..];
            let mut path = vec!["moeserve".to_string()];
            while let Some(sub) = rest.first().and_then(|w| cmd.find_subcommand(w).cloned()) {
                path.push(sub.get_name().to_string());
                cmd = sub;
                rest = &rest[1..];
            }
            for word in rest {
                for flag in word.split('|') {
                    let flag = flag.trim_matches(|c| matches!(c, '[' | ']' | '(' | ')'));
                    let Some(long) = flag.strip_prefix("--") else {
                        continue;
                    };
                    let long = long.split('=').next().unwrap();
                    let known =
                        long == "help" || cmd.get_arguments().any(|a| a.get_long() == Some(long));
                    assert!(
                        known,
                        "{name}: `{line}`: `{}` has no flag --{long}",
                        path.join(" ")
                    );
                }
            }
            checked += 1;
            let concrete =
                !line.contains(['[', ']', '|', '(']) && !argv.iter().any(|w| is_placeholder(w));
            if concrete {
                Cli::command()
                    .try_get_matches_from(&argv)
                    .unwrap_or_else(|e| panic!("{name}: `{line}` does not parse:\n{e}"));
                parsed += 1;
            }
        }
    }
    assert!(
        checked >= 20 && parsed >= 5,
        "checked {checked} command lines, parsed {parsed}"
    );
}

#[test]
fn placeholders_and_words_are_read_as_a_shell_would() {
    assert_eq!(
        words(r#"moeserve generate --prompt "a b" --x 'c d'"#),
        ["moeserve", "generate", "--prompt", "a b", "--x", "c d"]
    );
    for p in ["DIR", "N", "FILE.toml", "DIR-int8", "ORG/NAME"] {
        assert!(is_placeholder(p), "{p}");
    }
    for w in ["Qwen/Qwen3-30B-A3B", "4GiB", "main", "0.0.0.0"] {
        assert!(!is_placeholder(w), "{w}");
    }
}
