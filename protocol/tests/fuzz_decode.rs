//! Fuzzing the one parse point of the wire (proptest): arbitrary bytes and
//! structured mutations of valid envelopes never panic, every refusal is a typed
//! `DecodeError` with a known metric label, and whatever is accepted is valid and
//! survives a round trip.
//!
//! The corpus lives in the repository: `tests/corpus/*.json` (hand-picked hard
//! cases, replayed on every run) and `tests/fuzz_decode.proptest-regressions`
//! (inputs proptest once found failing, replayed first; commit new ones).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;

use mesh_protocol::{
    Applied, Declaration, DeclarationItems, DecodeError, Envelope, FileItem, FileMode, Heartbeat,
    Hello, MAX_DECLARATION_BYTES, MAX_REPORT_BYTES, NodeId, NodeLabelsChanged, Outcome,
    RecordEvent, RecordKind, Report, SealedFileItem, Section, sealing, validate_path,
};
use proptest::prelude::*;
use serde_json::{Value, json};

const LABELS: [&str; 6] = [
    "too_large",
    "malformed",
    "unsupported_version",
    "unknown_kind",
    "unsupported_section",
    "invalid",
];

fn typed(e: &DecodeError) {
    assert!(
        LABELS.contains(&e.metric_label()),
        "unknown label for {e:?}"
    );
    assert!(!e.to_string().is_empty());
}

/// Decode `bytes` every way the system does; never panics, errors are typed, and
/// what is accepted is valid and round-trips.
fn decode_all(bytes: &[u8]) {
    match Envelope::<Report>::decode(bytes, MAX_REPORT_BYTES) {
        Ok(env) => {
            let again = Envelope::<Report>::decode(&env.encode(), usize::MAX)
                .expect("an accepted report re-encodes to an accepted report");
            assert_eq!(again, env);
        }
        Err(e) => typed(&e),
    }
    match Envelope::<Declaration>::decode(bytes, MAX_DECLARATION_BYTES) {
        Ok(env) => {
            for f in &env.body.items.files {
                validate_path("path", &f.path).expect("accepted paths are valid");
                assert!(f.mode.bits() <= 0o7777);
            }
            assert!(env.body.generation >= 1);
            let again = Envelope::<Declaration>::decode(&env.encode(), usize::MAX)
                .expect("an accepted declaration re-encodes to an accepted one");
            assert_eq!(again, env);
        }
        Err(e) => typed(&e),
    }
    match RecordEvent::decode(bytes) {
        Ok(ev) => {
            let again = RecordEvent::decode(&ev.encode())
                .expect("an accepted record event re-encodes to an accepted one");
            assert_eq!(again, ev);
        }
        Err(e) => typed(&e),
    }
}

fn seal_key() -> sealing::SealSecretKey {
    sealing::SealSecretKey::from_seed([3; 32])
}

fn node() -> NodeId {
    NodeId::parse("node-a").expect("valid")
}

/// One valid envelope of every kind, as JSON values.
fn valid_envelopes() -> Vec<Value> {
    let mut applied = BTreeMap::new();
    applied.insert(Section::Config, 3);
    let reports = [
        Report::Hello(Hello {
            hostname: "h".into(),
            arch: "x86_64".into(),
            cpus: 2,
            memory_bytes: 1 << 30,
            labels: [("role".to_string(), "web".to_string())].into(),
            agent_version: "1".into(),
            public_key: None,
            seal_key: Some(seal_key().public().to_hex()),
            overlay: None,
            applied: applied.clone(),
            protocol: None,
            outage: None,
            metrics: None,
        }),
        Report::Heartbeat(Heartbeat {
            interval_ms: None,
            applied: applied.clone(),
        }),
        Report::Applied(Applied {
            section: Some(Section::Config),
            generation: Some(3),
            outcome: Outcome::Applied,
            items: vec![],
            error: None,
            unsupported_section: None,
        }),
    ];
    let mut out: Vec<Value> = reports
        .into_iter()
        .map(|r| serde_json::from_slice(&Envelope::new(node(), 7, r).encode()).expect("json"))
        .collect();
    let decl = Declaration {
        section: Section::Config,
        generation: 4,
        items: DeclarationItems {
            heartbeat: None,
            files: vec![FileItem {
                path: "/etc/motd".into(),
                content: "hi".into(),
                mode: FileMode::new(0o644).expect("mode"),
            }],
            units: vec![],
            secrets: vec![SealedFileItem {
                path: "/etc/app/token".into(),
                mode: FileMode::new(0o600).expect("mode"),
                secret: "token".into(),
                version: 1,
                sealed: sealing::seal(
                    &seal_key().public(),
                    &sealing::secret_aad("node-a", "/etc/app/token"),
                    b"t0ken",
                    [9; 32],
                )
                .expect("seal"),
            }],
            ..Default::default()
        },
    };
    out.push(serde_json::from_slice(&Envelope::new(node(), 4, decl).encode()).expect("json"));
    out.push(
        serde_json::from_slice(
            &RecordEvent::new(RecordKind::NodeJoined(NodeLabelsChanged {
                node: node(),
                labels: Default::default(),
                version: 1,
            }))
            .encode(),
        )
        .expect("json"),
    );
    out
}

/// Arbitrary JSON values, including the awkward ones: huge and negative numbers,
/// floats, long and control-character strings, nesting.
fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,40}".prop_map(Value::String),
        prop_oneof![
            Just("/etc/../../x"),
            Just("../x"),
            Just("/a//b"),
            Just("/a/./b"),
            Just("/\u{0}"),
            Just("relative"),
            Just("hello"),
            Just("declaration"),
            Just("node-b"),
            Just("01890000-0000-7000-8000-000000000000"),
            Just("2024-01-01T00:00:00Z"),
        ]
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,10}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Every path to a value inside `v` (object keys and array indices).
fn paths(v: &Value, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    out.push(prefix.clone());
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                let mut p = prefix.clone();
                p.push(k.clone());
                paths(child, p, out);
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                let mut p = prefix.clone();
                p.push(i.to_string());
                paths(child, p, out);
            }
        }
        _ => {}
    }
}

fn at<'a>(v: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    let mut cur = v;
    for p in path {
        cur = match cur {
            Value::Object(m) => m.get_mut(p)?,
            Value::Array(a) => a.get_mut(p.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

#[derive(Debug, Clone)]
enum Mutation {
    Replace(usize, Value),
    Remove(usize),
    AddField(usize, String, Value),
}

fn apply(v: &mut Value, m: &Mutation) {
    let mut all = Vec::new();
    paths(v, Vec::new(), &mut all);
    let pick = |i: usize| all[i % all.len()].clone();
    match m {
        Mutation::Replace(i, new) => {
            if let Some(slot) = at(v, &pick(*i)) {
                *slot = new.clone();
            }
        }
        Mutation::Remove(i) => {
            let path = pick(*i);
            if let Some((last, parent)) = path.split_last()
                && let Some(parent) = at(v, parent)
            {
                match parent {
                    Value::Object(m) => {
                        m.remove(last);
                    }
                    Value::Array(a) => {
                        if let Ok(n) = last.parse::<usize>()
                            && n < a.len()
                        {
                            a.remove(n);
                        }
                    }
                    _ => {}
                }
            }
        }
        Mutation::AddField(i, key, new) => {
            if let Some(Value::Object(m)) = at(v, &pick(*i)) {
                m.insert(key.clone(), new.clone());
            }
        }
    }
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), arb_json()).prop_map(|(i, v)| Mutation::Replace(i, v)),
        any::<usize>().prop_map(Mutation::Remove),
        (any::<usize>(), "[a-z_]{1,8}", arb_json())
            .prop_map(|(i, k, v)| Mutation::AddField(i, k, v)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&bytes);
    }

    #[test]
    fn arbitrary_json_never_panics(v in arb_json()) {
        decode_all(&serde_json::to_vec(&v).expect("json"));
    }

    #[test]
    fn mutated_envelopes_never_panic(
        which in 0usize..5,
        mutations in prop::collection::vec(arb_mutation(), 1..4),
    ) {
        let mut v = valid_envelopes().swap_remove(which);
        for m in &mutations {
            apply(&mut v, m);
        }
        decode_all(&serde_json::to_vec(&v).expect("json"));
    }

    #[test]
    fn truncated_envelopes_are_malformed(which in 0usize..5, cut in any::<prop::sample::Index>()) {
        let bytes = serde_json::to_vec(&valid_envelopes().swap_remove(which)).expect("json");
        let cut = cut.index(bytes.len());
        let r = Envelope::<Report>::decode(&bytes[..cut], MAX_REPORT_BYTES);
        prop_assert!(matches!(r, Err(DecodeError::Malformed(_))), "{r:?}");
        let d = Envelope::<Declaration>::decode(&bytes[..cut], MAX_DECLARATION_BYTES);
        prop_assert!(matches!(d, Err(DecodeError::Malformed(_))), "{d:?}");
        prop_assert!(RecordEvent::decode(&bytes[..cut]).is_err());
    }

    #[test]
    fn bytes_flipped_in_valid_envelopes_never_panic(
        which in 0usize..5,
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = serde_json::to_vec(&valid_envelopes().swap_remove(which)).expect("json");
        for (i, b) in flips {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        decode_all(&bytes);
    }
}

#[test]
fn oversized_messages_are_too_large_before_parsing() {
    let mut bytes = serde_json::to_vec(&valid_envelopes().swap_remove(0)).expect("json");
    bytes.resize(MAX_REPORT_BYTES + 1, b' ');
    assert!(matches!(
        Envelope::<Report>::decode(&bytes, MAX_REPORT_BYTES),
        Err(DecodeError::TooLarge { .. })
    ));
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    decode_all(deep.as_bytes());
    let deep_body = format!(
        r#"{{"v":1,"id":"01890000-0000-7000-8000-000000000000","kind":"hello","node":"node-a","seq":1,"sent_at":"2024-01-01T00:00:00Z","body":{}{}}}"#,
        "{\"a\":".repeat(50_000),
        "}".repeat(50_000)
    );
    decode_all(deep_body.as_bytes());
}

/// The kept corpus: every file decodes without panic, and files named
/// `accept-*` must be accepted as a report or a declaration (an unknown field
/// included: bodies and envelopes ignore what this version does not know).
#[test]
fn corpus_replays() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("corpus dir") {
        let path = entry.expect("entry").path();
        let bytes = std::fs::read(&path).expect("read");
        decode_all(&bytes);
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("accept-") {
            assert!(
                Envelope::<Report>::decode(&bytes, MAX_REPORT_BYTES).is_ok()
                    || Envelope::<Declaration>::decode(&bytes, MAX_DECLARATION_BYTES).is_ok(),
                "{name} should be accepted"
            );
        } else {
            assert!(
                Envelope::<Report>::decode(&bytes, MAX_REPORT_BYTES).is_err()
                    && Envelope::<Declaration>::decode(&bytes, MAX_DECLARATION_BYTES).is_err(),
                "{name} should be refused"
            );
        }
        n += 1;
    }
    assert!(n >= 5, "the corpus is missing ({n} files)");
}

/// Forward compatibility: a field this version does not know is ignored and
/// noted, wherever it is; an unknown kind is still refused.
#[test]
fn unknown_fields_are_ignored_and_noted_unknown_kinds_refused() {
    let mut v = valid_envelopes().swap_remove(1); // heartbeat
    v["extra"] = json!(1);
    v["body"]["future"] = json!({"a": [1, 2]});
    let bytes = serde_json::to_vec(&v).expect("json");
    let (env, unknown) =
        Envelope::<Report>::decode_noting(&bytes, MAX_REPORT_BYTES).expect("accepted");
    assert!(matches!(env.body, Report::Heartbeat(_)));
    assert_eq!(unknown.count, 2, "{unknown:?}");
    assert_eq!(
        unknown.paths,
        vec!["extra".to_owned(), "body.future".to_owned()]
    );

    v["kind"] = json!("bogus");
    let err = Envelope::<Report>::decode(&serde_json::to_vec(&v).expect("json"), MAX_REPORT_BYTES)
        .unwrap_err();
    assert_eq!(err.metric_label(), "unknown_kind", "{err}");
}

/// A declaration of a section this version does not know is its own error
/// (the agent reports it unsupported), naming the section and generation.
#[test]
fn unknown_sections_are_unsupported_not_malformed() {
    let mut v = valid_envelopes().swap_remove(3); // declaration
    v["body"]["section"] = json!("observability");
    let err = Envelope::<Declaration>::decode(
        &serde_json::to_vec(&v).expect("json"),
        MAX_DECLARATION_BYTES,
    )
    .unwrap_err();
    assert_eq!(
        err,
        DecodeError::UnsupportedSection {
            section: "observability".into(),
            generation: Some(4)
        }
    );
    // A section name that is no name at all is invalid, not unsupported.
    v["body"]["section"] = json!("../x");
    let err = Envelope::<Declaration>::decode(
        &serde_json::to_vec(&v).expect("json"),
        MAX_DECLARATION_BYTES,
    )
    .unwrap_err();
    assert_eq!(err.metric_label(), "invalid", "{err}");
    // A heartbeat naming a section this version does not know keeps the rest.
    let mut hb = valid_envelopes().swap_remove(1);
    hb["body"]["applied"]["observability"] = json!(9);
    let (env, unknown) = Envelope::<Report>::decode_noting(
        &serde_json::to_vec(&hb).expect("json"),
        MAX_REPORT_BYTES,
    )
    .expect("accepted");
    let Report::Heartbeat(h) = env.body else {
        panic!("not a heartbeat")
    };
    assert_eq!(h.applied.get(&Section::Config), Some(&3));
    assert_eq!(unknown.paths, vec!["body.applied.observability".to_owned()]);
}
