//! Fuzzing the declaration applier (proptest), through the crate's public API:
//! whatever paths, contents and modes a declaration carries, and whatever traps
//! the root holds (symlinks to the outside, to the parent, to the state
//! directory, files where directories are expected), nothing is ever written,
//! changed or removed outside the root, nor inside the protected state directory.
//!
//! Each case builds a fresh parent directory holding `root/` (with the traps),
//! `root/state/` (protected) and `outside/` (sentinels), applies a sequence of
//! generations, then walks the whole parent directory and compares it with what
//! was there before, outside the root. Failing inputs are kept by proptest in
//! `tests/fuzz_apply.proptest-regressions` (commit them).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use mesh_host_agent::apply::Applier;
use mesh_host_agent::store::SectionState;
use mesh_protocol::{Declaration, DeclarationItems, FileItem, FileMode, Section};
use proptest::prelude::*;

/// Everything under `dir`: path → (kind, content or link target, mode).
fn walk(dir: &Path) -> BTreeMap<PathBuf, (char, Vec<u8>, u32)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            let mode = m.permissions().mode() & 0o7777;
            if m.file_type().is_symlink() {
                let target = std::fs::read_link(&p).unwrap_or_default();
                out.insert(p, ('l', target.into_os_string().into_encoded_bytes(), 0));
            } else if m.is_dir() {
                out.insert(p.clone(), ('d', Vec::new(), mode));
                stack.push(p);
            } else {
                out.insert(
                    p.clone(),
                    ('f', std::fs::read(&p).unwrap_or_default(), mode),
                );
            }
        }
    }
    out
}

/// A parent dir with `root/` full of traps, `root/state/` and `outside/`.
fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let parent = tempfile::tempdir().expect("tempdir");
    let root = parent.path().join("root");
    let state = root.join("state");
    let outside = parent.path().join("outside");
    for d in [&root, &state, &outside, &outside.join("sub")] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    std::fs::write(outside.join("secret"), b"outside").expect("write");
    std::fs::write(outside.join("sub/secret"), b"outside sub").expect("write");
    std::fs::write(state.join("store.json"), b"{}").expect("write");
    std::fs::write(root.join("plain"), b"a file, not a directory").expect("write");
    std::fs::create_dir_all(root.join("etc")).expect("mkdir");
    let link = |target: &Path, at: &str| {
        std::os::unix::fs::symlink(target, root.join(at)).expect("symlink");
    };
    link(&outside, "out");
    link(Path::new("../outside"), "rel-out");
    link(parent.path(), "up");
    link(&outside.join("secret"), "etc/secret-link");
    link(&state, "st");
    link(&root.join("etc"), "etc-in");
    link(Path::new("/"), "slash");
    (parent, root, state)
}

/// Paths made of the names the traps use, plus `.`/`..`/empty components and
/// arbitrary text.
fn arb_path() -> impl Strategy<Value = String> {
    let component = prop_oneof![
        Just("out".to_string()),
        Just("rel-out".to_string()),
        Just("up".to_string()),
        Just("st".to_string()),
        Just("state".to_string()),
        Just("slash".to_string()),
        Just("etc".to_string()),
        Just("etc-in".to_string()),
        Just("secret-link".to_string()),
        Just("secret".to_string()),
        Just("outside".to_string()),
        Just("root".to_string()),
        Just("plain".to_string()),
        Just("sub".to_string()),
        Just("..".to_string()),
        Just(".".to_string()),
        Just(String::new()),
        "[a-z]{1,3}",
        ".{1,6}",
    ];
    prop_oneof![
        8 => (any::<bool>(), prop::collection::vec(component, 1..5))
            .prop_map(|(abs, parts)| format!("{}{}", if abs { "/" } else { "" }, parts.join("/"))),
        1 => ".{0,30}",
    ]
}

fn arb_file() -> impl Strategy<Value = FileItem> {
    (arb_path(), ".{0,20}", 0u32..=0o7777).prop_map(|(path, content, mode)| FileItem {
        path,
        content,
        mode: FileMode::new(mode).unwrap_or_else(|_| unreachable!("mode is in range")),
    })
}

fn arb_generation() -> impl Strategy<Value = Vec<FileItem>> {
    prop::collection::vec(arb_file(), 0..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn nothing_is_written_outside_the_root(generations in prop::collection::vec(arb_generation(), 1..4)) {
        let (parent, root, state) = setup();
        let before = walk(parent.path());
        let applier = Applier::new(&root, std::slice::from_ref(&state)).expect("applier");
        let mut prev = SectionState::default();
        for (i, files) in generations.into_iter().enumerate() {
            let decl = Declaration {
                section: Section::Config,
                generation: i as u64 + 1,
                items: DeclarationItems { heartbeat: None, files, units: vec![], secrets: vec![], ..Default::default() },
            };
            let report = applier.apply(&decl, &prev);
            if let Some(state) = report.state {
                prev = state;
            }
        }
        let after = walk(parent.path());
        let inside = |p: &Path| p.starts_with(&root) && !p.starts_with(&state);
        // Nothing outside the root (or inside the state dir) appeared or changed…
        for (path, entry) in &after {
            if !inside(path) {
                prop_assert_eq!(before.get(path), Some(entry), "{} appeared or changed", path.display());
            }
        }
        // …nor disappeared.
        for path in before.keys() {
            if !inside(path) {
                prop_assert!(after.contains_key(path), "{} was removed", path.display());
            }
        }
    }
}
