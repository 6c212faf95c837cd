//! Grammars over a real tokenizer (the GPT-OSS fixture's byte-level BPE, 384 tokens): walks
//! that pick any allowed token at random always end in output the grammar describes.

use std::path::PathBuf;

use moeserve_structured::{
    GrammarCompiler, GrammarSpec, JsonWhitespace, StructuredError, StructuredOutput,
};
use moeserve_text::tokenizer::{SpecialTokens, Tokenizer};
use serde_json::{Value, json};

const EOS: [u32; 3] = [2, 8, 1];

fn tokenizer() -> Tokenizer {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gpt-oss-harmony");
    Tokenizer::from_dir(dir).unwrap()
}

fn compiler() -> (GrammarCompiler, Tokenizer) {
    let tok = tokenizer();
    (
        GrammarCompiler::new(&tok, tok.vocab_size(), &EOS).unwrap(),
        tok,
    )
}

/// xorshift64*, so the walks are reproducible without a dependency.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

/// Samples uniformly among the tokens the grammar allows until it ends (an eos token or the
/// grammar finished); returns the text without the eos.
fn walk(
    compiler: &GrammarCompiler,
    tok: &Tokenizer,
    output: &StructuredOutput,
    seed: u64,
) -> String {
    let mut grammar = compiler.compile(output).unwrap();
    let mut rng = Rng(seed);
    let mut ids = Vec::new();
    let vocab = compiler.vocab_size();
    for _ in 0..4000 {
        let mut logits = vec![0.0f32; vocab];
        grammar.apply_mask(&mut logits).unwrap();
        let allowed: Vec<u32> = (0..vocab as u32)
            .filter(|&t| logits[t as usize] == 0.0)
            .collect();
        assert!(
            !allowed.is_empty(),
            "the grammar allows no token after {ids:?}"
        );
        let token = allowed[rng.below(allowed.len())];
        assert!(grammar.allows(token).unwrap());
        grammar.accept(token).unwrap();
        if EOS.contains(&token) {
            break;
        }
        ids.push(token);
        if grammar.is_finished() {
            break;
        }
    }
    assert!(grammar.is_finished(), "the walk did not end: {ids:?}");
    tok.decode(&ids, SpecialTokens::Keep).unwrap()
}

#[test]
fn json_schema_walks_give_valid_json_of_the_schema() {
    let (compiler, tok) = compiler();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"], "additionalProperties": false}
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": false
    });
    let output = StructuredOutput::new(GrammarSpec::JsonSchema(schema));
    for seed in 1..=10 {
        let text = walk(&compiler, &tok, &output, seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["name"].as_str().unwrap().chars().count() <= 6, "{text}");
        assert!((0..=120).contains(&v["age"].as_i64().unwrap()), "{text}");
        assert!(
            ["cat", "dog"].contains(&v["pet"]["kind"].as_str().unwrap()),
            "{text}"
        );
    }
}

#[test]
fn compact_json_has_no_whitespace_between_tokens() {
    let (compiler, tok) = compiler();
    let mut output = StructuredOutput::new(GrammarSpec::JsonSchema(json!({
        "type": "object",
        "properties": {"a": {"type": "integer", "maximum": 9, "minimum": 0}, "b": {"enum": [true, false]}},
        "required": ["a", "b"], "additionalProperties": false
    })));
    output.whitespace = JsonWhitespace {
        compact: true,
        pattern: None,
    };
    for seed in 1..=5 {
        let text = walk(&compiler, &tok, &output, seed);
        assert!(!text.contains(' ') && !text.contains('\n'), "{text:?}");
        serde_json::from_str::<Value>(&text).unwrap();
    }
}

#[test]
fn json_object_regex_choice_and_grammars_constrain() {
    let (compiler, tok) = compiler();
    let object = StructuredOutput::new(GrammarSpec::JsonSchema(json!({
        "type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"], "additionalProperties": false
    })));
    assert!(
        serde_json::from_str::<Value>(&walk(&compiler, &tok, &object, 3))
            .unwrap()
            .is_object()
    );

    let regex = StructuredOutput::new(GrammarSpec::Regex("[a-c]{2,4}-[0-9]".into()));
    for seed in 1..=5 {
        let text = walk(&compiler, &tok, &regex, seed);
        let (head, tail) = text.split_once('-').unwrap();
        assert!(
            (2..=4).contains(&head.len()) && head.chars().all(|c| "abc".contains(c)),
            "{text}"
        );
        assert!(
            tail.len() == 1 && tail.chars().all(|c| c.is_ascii_digit()),
            "{text}"
        );
    }

    let choices = vec![
        "yes".to_string(),
        "no \"way\"".to_string(),
        "maybe".to_string(),
    ];
    let choice = StructuredOutput::new(GrammarSpec::Choice(choices.clone()));
    for seed in 1..=8 {
        assert!(choices.contains(&walk(&compiler, &tok, &choice, seed)));
    }

    let lark = StructuredOutput::new(GrammarSpec::Grammar(
        "start: \"(\" num (\",\" num)? \")\"\nnum: /[0-9]{1,2}/".into(),
    ));
    let gbnf = StructuredOutput::new(GrammarSpec::Grammar(
        "root ::= \"(\" num (\",\" num)? \")\"\nnum ::= [0-9] [0-9]?".into(),
    ));
    for g in [&lark, &gbnf] {
        for seed in 1..=5 {
            let text = walk(&compiler, &tok, g, seed);
            let inner = text
                .strip_prefix('(')
                .and_then(|t| t.strip_suffix(')'))
                .unwrap();
            assert!(
                inner
                    .split(',')
                    .all(|n| (1..=2).contains(&n.len()) && n.parse::<u32>().is_ok()),
                "{text}"
            );
        }
    }
}

#[test]
fn invalid_constraints_are_errors_that_say_what() {
    let (compiler, _) = compiler();
    let err = |spec| compiler.compile(&StructuredOutput::new(spec)).unwrap_err();
    let e = err(GrammarSpec::JsonSchema(
        json!({"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
    ));
    assert!(
        matches!(
            e,
            StructuredError::Invalid {
                kind: "json schema",
                ..
            }
        ),
        "{e}"
    );
    assert!(matches!(
        err(GrammarSpec::JsonSchema(json!(3))),
        StructuredError::Invalid { .. }
    ));
    assert!(matches!(
        err(GrammarSpec::Regex("[a-".into())),
        StructuredError::Invalid { kind: "regex", .. }
    ));
    assert!(matches!(
        err(GrammarSpec::Choice(vec![])),
        StructuredError::Invalid { kind: "choice", .. }
    ));
    let e = err(GrammarSpec::Grammar("start: undefined_rule".into()));
    assert!(e.to_string().contains("undefined_rule"), "{e}");
    assert!(matches!(
        err(GrammarSpec::Grammar("item ::= \"a\"".into())),
        StructuredError::Invalid {
            kind: "grammar",
            ..
        }
    ));
}

/// A grammar applied `after` a trigger allows everything until the trigger has been generated
/// (a near miss does not wake it), then constrains as it would from the start.
#[test]
fn a_grammar_after_a_trigger_sleeps_until_the_trigger_then_constrains() {
    let (compiler, tok) = compiler();
    let trigger = tok
        .encode_with_special_tokens("<|channel|>final<|message|>")
        .unwrap();
    assert!(trigger.len() >= 3, "{trigger:?}");
    let choice = StructuredOutput::new(GrammarSpec::Choice(vec!["yes".into(), "no".into()]));
    let mut grammar = compiler.compile(&choice).unwrap().after(trigger.clone());
    let vocab = compiler.vocab_size();
    let allowed = |g: &mut moeserve_structured::Grammar| {
        let mut logits = vec![0.0f32; vocab];
        g.compute_mask().unwrap();
        g.apply_mask(&mut logits).unwrap();
        logits.iter().filter(|l| l.is_finite()).count()
    };
    // The reasoning first: free text, and a trigger broken off half-way.
    let free = tok
        .encode_with_special_tokens(
            "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>",
        )
        .unwrap();
    for &t in &free {
        assert_eq!(allowed(&mut grammar), vocab);
        assert!(grammar.allows(t).unwrap());
        grammar.accept(t).unwrap();
        assert!(!grammar.is_finished());
    }
    assert!(grammar.is_asleep());
    for &t in &trigger[1..] {
        grammar.accept(t).unwrap();
    }
    // Woken: only a choice's tokens now, and it ends with one.
    assert!(!grammar.is_asleep());
    assert!(allowed(&mut grammar) < vocab / 4);
    for t in tok.encode("yes").unwrap() {
        assert!(grammar.allows(t).unwrap());
        grammar.accept(t).unwrap();
    }
    assert!(grammar.is_finished());
    let no = tok.encode("n").unwrap()[0];
    let mut fresh = compiler.compile(&choice).unwrap().after(trigger);
    assert!(fresh.allows(no).unwrap() && fresh.clone().is_asleep());
}
