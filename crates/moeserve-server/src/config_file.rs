//! `serve --config FILE.toml`: every flag of `serve` is a key of the file (the flag's name in
//! snake_case). The file is read into the same command line the flags make: each key becomes
//! its flag (unless that flag was given, on the command line or through its environment
//! variable), so a value in the file is parsed and checked by the flag's own parser and no key
//! can drift from its flag. `--print-config` writes the effective settings back as such a file.

use std::ffi::{OsStr, OsString};
use std::path::Path;

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Args, Command};

use crate::cli::moe_args::MoeArgs;

/// Flags that are about the file itself, not settings.
const NOT_SETTINGS: [&str; 4] = ["config", "print_config", "help", "version"];

/// The table of MoE flags that may also be written as `[moe]` (as older files do).
pub const MOE_TABLE: &str = "moe";

/// A setting's key: the arg's id, which clap derives from the field name (snake_case).
fn settings(cmd: &Command) -> impl Iterator<Item = &Arg> {
    cmd.get_arguments().filter(|arg| {
        let id = arg.get_id().as_str();
        !(NOT_SETTINGS.contains(&id) || arg.is_hide_set() || arg.get_long().is_none())
    })
}

/// The hidden `--no-X` of an on-by-default switch `--X`, if it has one.
fn negation<'c>(cmd: &'c Command, arg: &Arg) -> Option<&'c Arg> {
    let id = format!("no_{}", arg.get_id());
    cmd.get_arguments().find(|a| a.get_id() == id.as_str())
}

fn is_switch(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::SetTrue)
}

/// Reads `path` and returns the command-line arguments its keys stand for, leaving out the
/// flags `given` says were set explicitly. Unknown keys and values the flag would refuse are
/// errors that name the file and the key.
pub fn file_args(
    cmd: &Command,
    path: &Path,
    given: impl Fn(&str) -> bool,
) -> Result<Vec<OsString>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    table_args(cmd, &text, given).map_err(|e| format!("config file {}: {e}", path.display()))
}

/// [`file_args`] on the file's text.
pub fn table_args(
    cmd: &Command,
    text: &str,
    given: impl Fn(&str) -> bool,
) -> Result<Vec<OsString>, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
    // The MoE flags may also sit in a `[moe]` table, as older files have them.
    let moe_flags = MoeArgs::augment_args(Command::new(MOE_TABLE));
    let is_moe = |key: &str| moe_flags.get_arguments().any(|a| a.get_id() == key);
    let mut entries = Vec::new();
    for (key, value) in &table {
        match value {
            toml::Value::Table(moe) if key == MOE_TABLE => {
                for (key, value) in moe {
                    if !is_moe(key) {
                        return Err(format!(
                            "`{key}` is not a MoE setting: move it out of [moe]"
                        ));
                    }
                    entries.push((key, value));
                }
            }
            _ => entries.push((key, value)),
        }
    }
    let mut args = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (key, value) in entries {
        if !seen.insert(key.as_str()) {
            return Err(format!("`{key}` is set twice (at the top and in [moe])"));
        }
        push_setting(cmd, setting(cmd, key)?, value, &given, &mut args)?;
    }
    Ok(args)
}

fn setting<'c>(cmd: &'c Command, key: &str) -> Result<&'c Arg, String> {
    settings(cmd)
        .find(|arg| arg.get_id() == key)
        .ok_or_else(|| match closest_key(cmd, key) {
            Some(near) => format!("unknown key `{key}` (did you mean `{near}`?)"),
            None => format!("unknown key `{key}`: keys are the serve flags in snake_case"),
        })
}

/// The known key nearest to a misspelt one, if any is near.
fn closest_key(cmd: &Command, key: &str) -> Option<String> {
    settings(cmd)
        .map(|arg| arg.get_id().to_string())
        .map(|id| (edit_distance(&id, key), id))
        .filter(|(d, _)| *d <= 3)
        .min()
        .map(|(_, id)| id)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

fn push_setting(
    cmd: &Command,
    arg: &Arg,
    value: &toml::Value,
    given: &impl Fn(&str) -> bool,
    args: &mut Vec<OsString>,
) -> Result<(), String> {
    let key = arg.get_id().as_str();
    let negated = negation(cmd, arg);
    if given(key) || negated.is_some_and(|n| given(n.get_id().as_str())) {
        return Ok(());
    }
    let long = |arg: &Arg| OsString::from(format!("--{}", arg.get_long().unwrap_or(key)));
    let mine = if is_switch(arg) {
        match (value, negated) {
            (toml::Value::Boolean(true), _) => vec![long(arg)],
            (toml::Value::Boolean(false), Some(no)) => vec![long(no)],
            (toml::Value::Boolean(false), None) => vec![],
            _ => {
                return Err(format!(
                    "`{key}` is a switch: write `{key} = true` or `false`"
                ));
            }
        }
    } else {
        let text = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(format!(
                    "`{key}` takes one value, not a {}",
                    other.type_str()
                ));
            }
        };
        vec![long(arg), OsString::from(text)]
    };
    // The flag's own parser checks the value now, so that an error can name the key.
    let mut alone = vec![OsString::from(cmd.get_name())];
    alone.extend(mine.iter().cloned());
    if let Err(e) = cmd.clone().try_get_matches_from(alone) {
        let why = e.kind().as_str().unwrap_or("invalid value");
        let detail = e.to_string();
        let detail = detail
            .lines()
            .next()
            .unwrap_or(why)
            .trim_start_matches("error: ");
        return Err(format!("`{key} = {value}`: {detail}"));
    }
    args.extend(mine);
    Ok(())
}

/// The flags given explicitly on the command line, as arguments again.
pub fn command_line_args(cmd: &Command, matches: &ArgMatches) -> Vec<OsString> {
    let mut args = Vec::new();
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        if matches.value_source(id) != Some(ValueSource::CommandLine) {
            continue;
        }
        let Some(long) = arg.get_long() else { continue };
        let flag = OsString::from(format!("--{long}"));
        if is_switch(arg) {
            if matches.get_flag(id) {
                args.push(flag);
            }
            continue;
        }
        for value in matches.get_raw(id).into_iter().flatten() {
            args.push(flag.clone());
            args.push(value.to_os_string());
        }
    }
    args
}

/// The effective settings (flags over file over defaults) as a `--config` file. A secret
/// (`api_key`) is never written: it is noted as set, to be given again by flag or environment.
pub fn print(cmd: &Command, matches: &ArgMatches, secrets: &[&str]) -> String {
    let mut out = String::from(
        "# moeserve serve: effective settings (flags over --config file over defaults).\n\
         # Feed back with `moeserve serve --config FILE`.\n",
    );
    for arg in settings(cmd) {
        let id = arg.get_id().as_str();
        out.push('\n');
        if let Some(help) = arg.get_help() {
            push_comment(&mut out, &help.to_string());
        }
        if is_switch(arg) {
            let on = match negation(cmd, arg) {
                Some(no) => !matches.get_flag(no.get_id().as_str()),
                None => matches.get_flag(id),
            };
            out.push_str(&format!("{id} = {on}\n"));
            continue;
        }
        let values: Vec<&OsStr> = matches.get_raw(id).into_iter().flatten().collect();
        match values.as_slice() {
            [] => out.push_str(&format!("# {id} = (not set)\n")),
            [_] if secrets.contains(&id) => out.push_str(&format!(
                "# {id} = (set; not printed: give it by flag or env)\n"
            )),
            [value] => out.push_str(&format!("{id} = {}\n", toml_value(value))),
            _ => unreachable!("serve's flags take one value each"),
        }
    }
    out
}

/// `text` as `# ` lines of at most about 100 columns.
fn push_comment(out: &mut String, text: &str) {
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() + word.len() > 98 {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
}

/// A flag's text as TOML: numbers stay numbers, everything else is a string. Either way it
/// reads back as the same text, so the round trip holds.
fn toml_value(raw: &OsStr) -> String {
    let text = raw.to_string_lossy();
    if text.parse::<i64>().is_ok() {
        return text.into_owned();
    }
    if text.contains('.') && text.parse::<f64>().is_ok_and(f64::is_finite) {
        return text.into_owned();
    }
    toml::Value::String(text.into_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misspelt_key_is_refused_with_the_nearest_one() {
        let cmd = Command::new("x")
            .arg(Arg::new("max_num_seqs").long("max-num-seqs"))
            .arg(Arg::new("port").long("port"));
        let err = table_args(&cmd, "max_num_seq = 8", |_| false).unwrap_err();
        assert!(err.contains("did you mean `max_num_seqs`"), "{err}");
        let err = table_args(&cmd, "colour = 1", |_| false).unwrap_err();
        assert!(err.contains("unknown key `colour`"), "{err}");
    }

    #[test]
    fn numbers_stay_numbers_and_text_is_quoted() {
        assert_eq!(toml_value(OsStr::new("8000")), "8000");
        assert_eq!(toml_value(OsStr::new("0.9")), "0.9");
        assert_eq!(toml_value(OsStr::new("1MiB")), "\"1MiB\"");
        assert_eq!(toml_value(OsStr::new("inf")), "\"inf\"");
    }
}
