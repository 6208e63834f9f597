//! The compatibility corpus: one message of every kind as protocol v1 writes it
//! (tests/compat/v1/: `report-<kind>.json`, `declaration-<section>.json`,
//! `record-<context>.<event>.json`, `logs_request.json` (what the controller
//! asks an agent on its declaration queue, decision 0033), and variants `<name>-<variant>.json` of a
//! report or declaration for optional fields added later in v1, such as
//! `report-hello-seal-key.json`, `declaration-inventory-endpoints.json`
//! (the mesh's endpoints, decision 0044) or
//! `declaration-delivery-artifact-keys.json` (the keys a node trusts for
//! artifacts, decision 0048)). Every later version must decode all of
//! them, know every field in them (a v1 field is never removed or renamed), and
//! accept them with fields it does not know added anywhere.
//!
//! The files were written by this crate (`MESH_WRITE_COMPAT_CORPUS=1 cargo
//! test -p mesh-protocol --test compat write_corpus -- --ignored`); never edit
//! or regenerate the v1 files once released: a new version gets its own
//! directory.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use mesh_protocol::{
    Applied, AuditEntry, Declaration, DeclarationItems, DesiredState, Envelope, FileItem, FileMode,
    Heartbeat, Hello, ItemOutcome, LivenessState, LogsRequest, MAX_DECLARATION_BYTES,
    MAX_REPORT_BYTES, ModulePlacement, ModuleRemoved, NodeId, NodeIdentityChanged,
    NodeLabelsChanged, NodeLiveness, Outcome, ProtocolRange, RECORD_EVENTS, RecordEvent,
    RecordKind, Report, ReportKind, RestartPolicy, SealedFileItem, Section, SettingsFile,
    SettingsFormat, UnitItem, UnitState, UnitStatus, Units, sealing, sealing::SealSecretKey,
};
use serde_json::{Value, json};
use uuid::Uuid;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/v1")
}

fn files() -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir())
        .expect("tests/compat/v1")
        .map(|e| {
            let path = e.expect("entry").path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_owned();
            (name, std::fs::read(&path).expect("read"))
        })
        .collect()
}

/// A decoded corpus message, and the fields its decoder did not know.
#[derive(Debug, PartialEq)]
enum Message {
    Report(Envelope<Report>),
    Declaration(Envelope<Declaration>),
    Record(RecordEvent),
    LogsRequest(Envelope<LogsRequest>),
}

fn decode(name: &str, bytes: &[u8]) -> (Message, usize) {
    if name.starts_with("report-") {
        let (env, unknown) = Envelope::<Report>::decode_noting(bytes, MAX_REPORT_BYTES)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            is_named(name, &format!("report-{}", env.kind())),
            "{name} holds another kind"
        );
        (Message::Report(env), unknown.count)
    } else if name.starts_with("declaration-") {
        let (env, unknown) = Envelope::<Declaration>::decode_noting(bytes, MAX_DECLARATION_BYTES)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            is_named(name, &format!("declaration-{}", env.body.section)),
            "{name} holds another section"
        );
        (Message::Declaration(env), unknown.count)
    } else if name.starts_with("logs_request") {
        let (env, unknown) = Envelope::<LogsRequest>::decode_noting(bytes, MAX_DECLARATION_BYTES)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(is_named(name, "logs_request"), "{name}: not a logs request");
        (Message::LogsRequest(env), unknown.count)
    } else if name.starts_with("record-") {
        let (event, unknown) =
            RecordEvent::decode_noting(bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        (Message::Record(event), unknown.count)
    } else {
        panic!("{name}: not a corpus file name");
    }
}

/// `name` is `<stem>.json` or a variant of it, `<stem>-<variant>.json`.
fn is_named(name: &str, stem: &str) -> bool {
    name.strip_prefix(stem)
        .and_then(|rest| rest.strip_suffix(".json"))
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
}

fn encode(m: &Message) -> Vec<u8> {
    match m {
        Message::Report(e) => e.encode(),
        Message::Declaration(e) => e.encode(),
        Message::Record(e) => e.encode(),
        Message::LogsRequest(e) => e.encode(),
    }
}

/// The corpus file name of a record event: its routing key, with an audit
/// event written by a context named `config`.
fn record_name(event: &RecordEvent) -> String {
    format!("record-{}.json", event.routing_key())
}

#[test]
fn every_v1_message_decodes_and_every_field_is_known() {
    for (name, bytes) in files() {
        let (message, unknown) = decode(&name, &bytes);
        assert_eq!(unknown, 0, "{name}: a v1 field is no longer known");
        // What this version writes of it reads back the same.
        let (again, _) = decode(&name, &encode(&message));
        assert_eq!(again, message, "{name} does not survive a round trip");
    }
}

#[test]
fn the_corpus_holds_every_kind() {
    let names: Vec<String> = files().into_keys().collect();
    let mut expected: Vec<String> = ReportKind::ALL
        .iter()
        .map(|k| format!("report-{}.json", k.as_str()))
        .chain(Section::ALL.iter().map(|s| format!("declaration-{s}.json")))
        .chain(std::iter::once("logs_request.json".to_owned()))
        .chain(
            RECORD_EVENTS
                .iter()
                .map(|e| format!("record-{}.json", e.replace('*', "config"))),
        )
        .collect();
    expected.sort();
    for name in &expected {
        assert!(names.contains(name), "the v1 corpus lacks {name}");
    }
    for (name, bytes) in files() {
        if let (Message::Record(e), _) = decode(&name, &bytes) {
            let stem = record_name(&e);
            let stem = stem.strip_suffix(".json").unwrap_or(&stem);
            assert!(is_named(&name, stem), "{name} holds {stem}");
        }
    }
}

/// Add `"x_future_<n>"` fields to every object of `v` that holds fields (not
/// to the data maps `labels`, `env` and `options`, whose keys are data);
/// returns how many.
fn add_unknown_fields(v: &mut Value, n: &mut usize) {
    match v {
        Value::Object(m) => {
            for (key, child) in m.iter_mut() {
                if key != "labels" && key != "env" && key != "options" {
                    add_unknown_fields(child, n);
                }
            }
            *n += 1;
            m.insert(
                format!("x_future_{n}"),
                json!({"nested": [1, {"deep": true}], "n": *n}),
            );
        }
        Value::Array(a) => a.iter_mut().for_each(|c| add_unknown_fields(c, n)),
        _ => {}
    }
}

#[test]
fn v1_messages_with_unknown_fields_everywhere_decode_the_same() {
    for (name, bytes) in files() {
        let (plain, _) = decode(&name, &bytes);
        let mut v: Value = serde_json::from_slice(&bytes).expect("json");
        let mut added = 0;
        add_unknown_fields(&mut v, &mut added);
        let (message, unknown) = decode(&name, &serde_json::to_vec(&v).expect("json"));
        assert_eq!(message, plain, "{name}");
        // Each added field is noted (a key added to `applied` reads as a
        // section this version does not know: ignored and noted too).
        assert_eq!(
            unknown, added,
            "{name}: {added} unknown fields added, {unknown} noted"
        );
    }
}

#[test]
fn an_older_agents_hello_speaks_v1() {
    let bytes = std::fs::read(dir().join("report-hello.json")).expect("hello");
    let env = Envelope::<Report>::decode(&bytes, MAX_REPORT_BYTES).expect("hello");
    let Report::Hello(h) = env.body else {
        panic!("not a hello")
    };
    assert_eq!(h.protocol(), ProtocolRange::V1);
    assert_eq!(h.refusal(ProtocolRange::THIS), None);
}

// ---- writing the corpus (once, for v1) ----

fn at() -> DateTime<Utc> {
    "2026-11-30T12:00:00Z".parse().expect("time")
}

fn id(n: u8) -> Uuid {
    Uuid::parse_str(&format!("01890000-0000-7000-8000-0000000000{n:02x}")).expect("uuid")
}

fn node() -> NodeId {
    NodeId::parse("node-a").expect("node")
}

fn envelope<B: mesh_protocol::Body>(n: u8, seq: u64, body: B) -> Envelope<B> {
    Envelope {
        id: id(n),
        node: node(),
        seq,
        sent_at: at(),
        body,
    }
}

/// Writes tests/compat/v1/ from the values below, only when asked to twice
/// (`--ignored` and `MESH_WRITE_COMPAT_CORPUS=1`): a tool, not a test, so it
/// is ignored (never counted as a passing test) and fails when run without
/// the variable. The v1 corpus is frozen: never rewrite it.
#[test]
#[ignore = "writes the compat corpus: MESH_WRITE_COMPAT_CORPUS=1 and --ignored"]
fn write_corpus() {
    assert!(
        std::env::var_os("MESH_WRITE_COMPAT_CORPUS").is_some(),
        "write_corpus rewrites tests/compat/v1/: set MESH_WRITE_COMPAT_CORPUS=1 to mean it"
    );
    let applied: BTreeMap<Section, u64> = [(Section::Inventory, 2), (Section::Config, 3)].into();
    let labels: mesh_protocol::Labels = [("role".to_owned(), "web".to_owned())].into();
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let reports = [
        Report::Hello(Hello {
            hostname: "host-a".into(),
            arch: "x86_64".into(),
            cpus: 2,
            memory_bytes: 8 << 30,
            labels: labels.clone(),
            agent_version: "0.1.0".into(),
            public_key: Some("ab".repeat(32)),
            seal_key: None,
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
            outcome: Outcome::Failed,
            items: vec![
                ItemOutcome {
                    item: "/etc/motd".into(),
                    ok: true,
                    error: None,
                },
                ItemOutcome {
                    item: "/etc/app.toml".into(),
                    ok: false,
                    error: Some("write: permission denied".into()),
                },
            ],
            error: None,
            unsupported_section: None,
        }),
        Report::Units(Units {
            units: vec![UnitStatus {
                reason: None,
                oom_kills: 0,
                uid: None,
                data_bytes: None,
                revision: None,
                name: "web-0".into(),
                module: "web".into(),
                state: UnitState::Running,
                pid: Some(4242),
                exit_code: Some(0),
                restarts: 1,
                started_at: Some(at()),
            }],
        }),
    ];
    for (n, r) in reports.into_iter().enumerate() {
        let name = format!("report-{}.json", r.report_kind().as_str());
        let n = u8::try_from(n).expect("few");
        out.push((name, envelope(n + 1, 10 + u64::from(n), r).encode()));
    }
    for (n, section) in Section::ALL.into_iter().enumerate() {
        let units = if section == Section::Inventory {
            vec![UnitItem {
                user: Default::default(),
                limits: Default::default(),
                stateful: false,
                artifact: None,
                revision: None,
                name: "web-0".into(),
                module: "web".into(),
                command: "/usr/bin/web".into(),
                args: vec!["--port".into(), "8080".into()],
                env: [("MODE".to_owned(), "prod".to_owned())].into(),
                working_dir: Some("/srv/web".into()),
                restart: RestartPolicy::OnFailure,
                desired: DesiredState::Running,
                probes: Vec::new(),
            }]
        } else {
            Vec::new()
        };
        let d = Declaration {
            section,
            generation: 4,
            items: DeclarationItems {
                heartbeat: None,
                files: vec![FileItem {
                    path: format!("/etc/mesh/{section}.conf"),
                    content: "key = \"value\"\n".into(),
                    mode: FileMode::new(0o640).expect("mode"),
                }],
                units,
                secrets: Vec::new(),
                ..Default::default()
            },
        };
        let n = u8::try_from(n).expect("few");
        out.push((
            format!("declaration-{section}.json"),
            envelope(0x10 + n, 4, d).encode(),
        ));
    }
    // Later in v1: a hello stating its seal key, a config section with a secret.
    out.push((
        "report-hello-seal-key.json".into(),
        envelope(5, 14, Report::Hello(hello_with_seal_key())).encode(),
    ));
    out.push((
        "declaration-config-secret.json".into(),
        envelope(0x15, 5, config_with_secret()).encode(),
    ));
    let kinds = [
        RecordKind::NodeJoined(NodeLabelsChanged {
            node: node(),
            labels: labels.clone(),
            version: 1,
        }),
        RecordKind::NodeUpdated(NodeLabelsChanged {
            node: node(),
            labels,
            version: 2,
        }),
        RecordKind::NodeUnreachable(NodeLiveness {
            node: node(),
            state: LivenessState::Unreachable,
            at: at(),
            last_heard: Some(at()),
        }),
        RecordKind::NodeAlive(NodeLiveness {
            node: node(),
            state: LivenessState::Alive,
            at: at(),
            last_heard: Some(at()),
        }),
        RecordKind::NodeEnrolled(NodeIdentityChanged {
            node: node(),
            public_key: Some("cd".repeat(32)),
            at: at(),
            labels: None,
        }),
        RecordKind::NodeRevoked(NodeIdentityChanged {
            node: node(),
            public_key: None,
            at: at(),
            labels: None,
        }),
        RecordKind::NodeReadmitted(NodeIdentityChanged {
            node: node(),
            public_key: None,
            at: at(),
            labels: None,
        }),
        RecordKind::OperatorAudit {
            context: "config".into(),
            entry: AuditEntry {
                principal_id: id(0x30),
                principal: "ci-deployer".into(),
                role: "operator".into(),
                action: "PUT /v1/files/{name}".into(),
                target: "/v1/files/motd".into(),
                request_id: id(0x31),
                at: at(),
                outcome: "ok".into(),
                status: 200,
                detail: None,
            },
        },
        RecordKind::ModulePlaced(ModulePlacement {
            module: "web".into(),
            version: 3,
            nodes: vec![node(), NodeId::parse("node-b").expect("node")],
            settings_files: vec![
                SettingsFile {
                    name: "app.env".into(),
                    format: SettingsFormat::Env,
                },
                SettingsFile {
                    name: "app.toml".into(),
                    format: SettingsFormat::Toml,
                },
            ],
            ports: Vec::new(),
            requires: Vec::new(),
            provides: Vec::new(),
        }),
        RecordKind::ModuleRemoved(ModuleRemoved {
            module: "web".into(),
            version: 4,
        }),
    ];
    for (n, kind) in kinds.into_iter().enumerate() {
        let event = RecordEvent {
            id: id(0x20 + u8::try_from(n).expect("few")),
            sent_at: at(),
            kind,
        };
        out.push((record_name(&event), event.encode()));
    }
    for (name, bytes) in out {
        let pretty: Value = serde_json::from_slice(&bytes).expect("json");
        let mut text = serde_json::to_string_pretty(&pretty).expect("json");
        text.push('\n');
        std::fs::write(dir().join(name), text).expect("write");
    }
}

/// The key the corpus's secret is sealed to.
fn corpus_seal_key() -> SealSecretKey {
    SealSecretKey::from_seed([0x5e; 32])
}

const SECRET_PATH: &str = "/etc/mesh/db.password";

fn hello_with_seal_key() -> Hello {
    Hello {
        hostname: "host-a".into(),
        arch: "x86_64".into(),
        cpus: 2,
        memory_bytes: 8 << 30,
        labels: [("role".to_owned(), "web".to_owned())].into(),
        agent_version: "0.1.0".into(),
        public_key: Some("ab".repeat(32)),
        seal_key: Some(corpus_seal_key().public().to_hex()),
        overlay: None,
        applied: [(Section::Config, 4)].into(),
        protocol: Some(ProtocolRange::V1),
        outage: None,
        metrics: None,
    }
}

fn config_with_secret() -> Declaration {
    let sealed = sealing::seal(
        &corpus_seal_key().public(),
        &sealing::secret_aad("node-a", SECRET_PATH),
        b"s3cret\n",
        [0x42; 32],
    )
    .expect("seal");
    Declaration {
        section: Section::Config,
        generation: 5,
        items: DeclarationItems {
            files: vec![FileItem {
                path: "/etc/mesh/config.conf".into(),
                content: "key = \"value\"\n".into(),
                mode: FileMode::new(0o640).expect("mode"),
            }],
            units: Vec::new(),
            secrets: vec![SealedFileItem {
                path: SECRET_PATH.into(),
                mode: FileMode::new(0o600).expect("mode"),
                secret: "db-password".into(),
                version: 2,
                sealed,
            }],
            heartbeat: None,
            ..Default::default()
        },
    }
}

/// The sealing format is part of v1: the corpus's secret still opens, for its
/// node and path only, and the hello's seal key is the key it opens with.
#[test]
fn the_corpus_secret_opens_with_its_nodes_key() {
    let bytes = std::fs::read(dir().join("declaration-config-secret.json")).expect("corpus");
    let env = Envelope::<Declaration>::decode(&bytes, MAX_DECLARATION_BYTES).expect("decodes");
    let item = &env.body.items.secrets[0];
    let key = corpus_seal_key();
    let aad = sealing::secret_aad(env.node.as_str(), &item.path);
    assert_eq!(
        sealing::open(&key, &aad, &item.sealed).expect("opens"),
        b"s3cret\n"
    );
    let other = sealing::secret_aad("node-b", &item.path);
    assert!(sealing::open(&key, &other, &item.sealed).is_err());

    let bytes = std::fs::read(dir().join("report-hello-seal-key.json")).expect("corpus");
    let env = Envelope::<Report>::decode(&bytes, MAX_REPORT_BYTES).expect("decodes");
    let Report::Hello(h) = env.body else {
        panic!("not a hello")
    };
    assert_eq!(h.seal_key, Some(key.public().to_hex()));
    assert_eq!(h, hello_with_seal_key());
}

#[test]
fn a_hello_with_a_bad_seal_key_is_refused_naming_the_field() {
    let bytes = std::fs::read(dir().join("report-hello-seal-key.json")).expect("hello");
    let mut v: Value = serde_json::from_slice(&bytes).expect("json");
    for bad in ["zz".repeat(32), "ab".repeat(31), "00".repeat(32)] {
        v["body"]["seal_key"] = json!(bad);
        let err =
            Envelope::<Report>::decode(&serde_json::to_vec(&v).expect("json"), MAX_REPORT_BYTES)
                .unwrap_err();
        assert!(
            matches!(&err, mesh_protocol::DecodeError::Invalid { field, .. } if field == "body.seal_key"),
            "{err}"
        );
    }
}

#[test]
fn a_hello_whose_range_excludes_ours_is_refused_with_a_reason() {
    let bytes = std::fs::read(dir().join("report-hello.json")).expect("hello");
    let mut v: Value = serde_json::from_slice(&bytes).expect("json");
    v["body"]["protocol"] = json!({"min": 2, "max": 3});
    let env = Envelope::<Report>::decode(&serde_json::to_vec(&v).expect("json"), MAX_REPORT_BYTES)
        .expect("a v1 hello with a range decodes");
    let Report::Hello(h) = env.body else {
        panic!("not a hello")
    };
    let reason = h.refusal(ProtocolRange::THIS).expect("refused");
    assert!(
        reason.contains("v2..v3") && reason.contains("v1..v1"),
        "{reason}"
    );
    // A range that overlaps ours is spoken.
    v["body"]["protocol"] = json!({"min": 1, "max": 3});
    let env = Envelope::<Report>::decode(&serde_json::to_vec(&v).expect("json"), MAX_REPORT_BYTES)
        .expect("decodes");
    let Report::Hello(h) = env.body else {
        panic!("not a hello")
    };
    assert_eq!(h.refusal(ProtocolRange::THIS), None);
    // An empty range is invalid.
    v["body"]["protocol"] = json!({"min": 3, "max": 2});
    let err = Envelope::<Report>::decode(&serde_json::to_vec(&v).expect("json"), MAX_REPORT_BYTES)
        .unwrap_err();
    assert_eq!(err.metric_label(), "invalid", "{err}");
}
