//! The server's output parsers, compiled from their sources for fuzzing (they need only
//! serde_json): `tools` (one parser per tool-call dialect) and `reasoning` (the `<think>` split).

#[path = "../../crates/specula-server/src/tools/mod.rs"]
pub mod tools;

#[path = "../../crates/specula-server/src/reasoning.rs"]
pub mod reasoning;
