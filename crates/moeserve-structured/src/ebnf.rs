//! GBNF / EBNF (llama.cpp's grammar format, `rule ::= …`) rewritten as the Lark that
//! llguidance reads, so `guided_grammar` takes either, as vLLM does.
//!
//! The two differ in syntax only: `::=` is `:`; `root` is `start`; a character class `[a-z]`
//! is a regex `/[a-z]/` (in Lark brackets mean optional); `.` is any character; `#` starts a
//! comment; rule names may hold `-`, which Lark's may not; a rule's body may span lines, where
//! Lark continues a rule only on a line starting with `|`. Strings, groups, `|`, `*`, `+`, `?`
//! and `{m,n}` are the same.

/// The Lark grammar for a GBNF one; the error says what and where.
pub fn ebnf_to_lark(ebnf: &str) -> Result<String, String> {
    let chars: Vec<char> = ebnf.chars().collect();
    let mut out = String::with_capacity(ebnf.len() + 16);
    let mut i = 0;
    let mut line = 1;
    let mut rules = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\n' => {
                line += 1;
                out.push(' ');
                i += 1;
            }
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '"' => {
                let end = string_end(&chars, i).ok_or_else(|| {
                    format!("line {line}: the string that starts here is not closed")
                })?;
                out.extend(&chars[i..=end]);
                i = end + 1;
            }
            '[' => {
                let end = class_end(&chars, i).ok_or_else(|| {
                    format!("line {line}: the character class that starts here is not closed")
                })?;
                out.push('/');
                for &ch in &chars[i..=end] {
                    if ch == '/' {
                        out.push('\\');
                    }
                    out.push(ch);
                }
                out.push('/');
                i = end + 1;
            }
            '.' => {
                out.push_str("/(?s:.)/");
                i += 1;
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_')
                {
                    i += 1;
                }
                let name: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && (chars[j] == ' ' || chars[j] == '\t') {
                    j += 1;
                }
                let defines = chars[j..].starts_with(&[':', ':', '=']);
                // `{2,5}` counts are copied as they are.
                if name.chars().all(|ch| ch.is_ascii_digit()) {
                    out.push_str(&name);
                    continue;
                }
                let lark = lark_name(&name);
                if defines {
                    if rules > 0 {
                        out.push('\n');
                    }
                    rules += 1;
                    out.push_str(&lark);
                    out.push(':');
                    i = j + 3;
                } else {
                    out.push_str(&lark);
                }
            }
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                return Err(format!("line {line}: `::=` without a rule name before it"));
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    if rules == 0 {
        return Err("no rule (`name ::= …`) in the grammar".to_string());
    }
    if !ebnf_defines_root(ebnf) {
        return Err("the grammar has no `root` rule, where output starts".to_string());
    }
    let mut lark = out.trim_start().to_string();
    lark.push('\n');
    Ok(lark)
}

/// `root` is Lark's `start`; `-` is not allowed in Lark's names; upper case would mean a
/// terminal. A rule the GBNF calls `start` is renamed so it cannot clash with `root`.
fn lark_name(name: &str) -> String {
    match name {
        "root" => "start".to_string(),
        "start" => "start_rule".to_string(),
        _ => name.to_ascii_lowercase().replace('-', "_"),
    }
}

fn ebnf_defines_root(ebnf: &str) -> bool {
    ebnf.lines().any(|l| {
        l.trim_start()
            .strip_prefix("root")
            .is_some_and(|rest| rest.trim_start().starts_with("::="))
    })
}

/// Index of the `"` that closes the string opening at `start`.
fn string_end(chars: &[char], start: usize) -> Option<usize> {
    let mut i = start + 1;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            '"' => return Some(i),
            '\n' => return None,
            _ => i += 1,
        }
    }
    None
}

/// Index of the `]` that closes the class opening at `start`.
fn class_end(chars: &[char], start: usize) -> Option<usize> {
    let mut i = start + 1;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            ']' => return Some(i),
            '\n' => return None,
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_classes_and_comments_become_lark() {
        let gbnf = "# a list\nroot ::= item (\",\" item)*\nitem ::= [a-z/]+ | \"x\\\"y\"\n  | num-ber # trailing\nnum-ber ::= [0-9]{1,3} .\n";
        let lark = ebnf_to_lark(gbnf).unwrap();
        assert_eq!(
            lark,
            "start: item (\",\" item)* \nitem: /[a-z\\/]/+ | \"x\\\"y\"   | num_ber  \nnum_ber: /[0-9]/{1,3} /(?s:.)/ \n"
        );
    }

    #[test]
    fn malformed_grammars_say_where() {
        assert!(
            ebnf_to_lark("root ::= \"abc\n")
                .unwrap_err()
                .contains("line 1")
        );
        assert!(ebnf_to_lark("item ::= \"a\"").unwrap_err().contains("root"));
        assert!(
            ebnf_to_lark("root ::= [a-z\n")
                .unwrap_err()
                .contains("class")
        );
    }
}
