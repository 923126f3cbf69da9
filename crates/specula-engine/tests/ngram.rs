//! The n-gram drafter on the catalog's real tokenizers: structural matches and numbers that
//! count on, spelt as the tokenizer spells them (the unit tests in `speculative::ngram` use a
//! synthetic vocabulary; exactness with the models is the G-gate in `tests/spec.rs`).

mod common;

use candle_core::quantized::gguf_file;
use specula_engine::speculative::ngram::NgramDrafter;
use specula_engine::tokenizer::Tokenizer;

const MODELS: [&str; 3] = [
    "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b-instruct",
];

fn tokenizer(model: &str) -> Tokenizer {
    let path = common::model_path(model);
    let mut f = std::fs::File::open(&path).expect("open model");
    let content = gguf_file::Content::read(&mut f).expect("gguf header");
    Tokenizer::from_gguf(&content.metadata).expect("tokenizer")
}

/// Encodes `written`, drafts `k` tokens, and returns the draft's text.
fn draft(t: &Tokenizer, written: &str, k: usize) -> String {
    let d = NgramDrafter::default().with_numbers(t.numbers());
    let ids = t.encode(written).expect("encode");
    t.decode(&d.lookup(&ids, k))
}

#[test]
fn numbers_count_on_in_the_tokenizers_own_spelling() {
    for model in MODELS {
        let t = tokenizer(model);
        let records: String = (1..=9)
            .map(|n| format!("  {{\"id\": {n}, \"name\": \"user_{n}\", \"active\": true}},\n"))
            .collect();
        // Inside the tenth record, after its id's first digit: the id is completed as 10, the
        // rest of the record follows with user_10, and the eleventh record starts (the draft
        // ends where the copied text does: at the context's own last digit).
        let written = format!("[\n{records}  {{\"id\": 1");
        let want = "0, \"name\": \"user_10\", \"active\": true},\n  {\"id\": 1";
        let k = t.encode(want).expect("encode").len();
        assert_eq!(draft(&t, &written, k), want, "{model}");

        // Squares continue quadratically: after `6:` comes 36.
        let squares: String = (1..=5).map(|n| format!("    {n}: {},\n", n * n)).collect();
        let written = format!("{{\n{squares}    6:");
        let want = " 36,\n    7:";
        let k = t.encode(want).expect("encode").len();
        assert_eq!(draft(&t, &written, k), want, "{model}");

        // A row of a table written out again keeps its numbers.
        let table = "Bergen,2026-04-01,10,2\nLyon,2026-04-01,18,15\nPorto,2026-04-01,16,7\n";
        let written = format!("{table}\nThe rows again:\nBergen,2026-04-01,10,2\nLyon,2026");
        let want = "-04-01,18,15\nPorto";
        let k = t.encode(want).expect("encode").len();
        assert_eq!(draft(&t, &written, k), want, "{model}");
    }
}
