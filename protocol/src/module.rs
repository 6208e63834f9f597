//! Where modules run, as inventory tells the record: the bodies of
//! `inventory.module.placed` and `inventory.module.removed`, and the settings
//! files a module declares (which the config context renders on its nodes).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::{DecodeError, NodeId};

/// The most settings files one module may declare.
pub const MAX_SETTINGS_FILES: usize = 16;

/// The format a settings file is rendered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum SettingsFormat {
    /// `KEY=value` lines.
    Env,
    /// One JSON object.
    Json,
    /// One TOML table.
    Toml,
}

/// A settings file a module declares: config renders the module's settings into
/// it, at `/modules/<module>/<name>` on every node that runs the module.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SettingsFile {
    /// A plain file name: 1 to 63 of `A-Z a-z 0-9 . _ -`, not `.` or `..`.
    pub name: String,
    /// `env`, `json` or `toml`.
    pub format: SettingsFormat,
}

/// Check a plain file name (`field` names it in the error): 1 to 63 of
/// `[A-Za-z0-9._-]`, not `.` or `..`. A module's settings files and its
/// granted secrets' files are named so, under `/modules/<module>/`.
pub fn validate_file_name(field: &str, name: &str) -> Result<(), DecodeError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && name != "."
        && name != "..";
    if ok {
        Ok(())
    } else {
        Err(DecodeError::invalid(
            field,
            format!(
                "`{}`: a plain file name, 1 to 63 characters of A-Z a-z 0-9 . _ -, not . or ..",
                name.chars().take(80).collect::<String>()
            ),
        ))
    }
}

/// Check a settings file name: a plain file name ([`validate_file_name`])
/// other than `secrets`, the directory of the module's granted secrets.
pub fn validate_settings_file_name(field: &str, name: &str) -> Result<(), DecodeError> {
    validate_file_name(field, name)?;
    if name == "secrets" {
        return Err(DecodeError::invalid(
            field,
            "`secrets` is the directory of the module's granted secrets: choose another name",
        ));
    }
    Ok(())
}

/// Check a module's settings files (`field` names the list in errors, e.g.
/// `settings_files`): at most [`MAX_SETTINGS_FILES`], each name valid, no
/// name twice.
pub fn validate_settings_files(field: &str, files: &[SettingsFile]) -> Result<(), DecodeError> {
    if files.len() > MAX_SETTINGS_FILES {
        return Err(DecodeError::invalid(
            field,
            format!(
                "{} settings files, at most {MAX_SETTINGS_FILES}",
                files.len()
            ),
        ));
    }
    let mut seen = BTreeSet::new();
    for (i, f) in files.iter().enumerate() {
        let at = format!("{field}[{i}].name");
        validate_settings_file_name(&at, &f.name)?;
        if !seen.insert(f.name.as_str()) {
            return Err(DecodeError::invalid(
                at,
                format!("`{}` is declared twice", f.name),
            ));
        }
    }
    Ok(())
}

/// Check a module's name (`field` names it in the error): 1 to 48 of
/// `[a-z0-9-]`, starting with a letter or digit. The one rule every context
/// that names modules applies (inventory adds its own on top).
pub fn validate_module_name(field: &str, module: &str) -> Result<(), DecodeError> {
    crate::names::check(field, module, &crate::names::MODULE)
}

/// Body of `inventory.module.placed`: the nodes a module has assignments on
/// (any role: a replica being replaced keeps its node here until its
/// assignment goes), and its settings files. Written whenever either changes,
/// and when the module is created (`nodes` empty until it is placed).
/// `version` grows with every event of the module, across delete and
/// re-create: a receiver keeps the newest and ignores older ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModulePlacement {
    pub module: String,
    pub version: i64,
    /// Sorted, without duplicates.
    pub nodes: Vec<NodeId>,
    #[serde(default)]
    pub settings_files: Vec<SettingsFile>,
    /// The module's ports: who may reach each over the overlay, and which
    /// are exposed publicly (connectivity). Absent when the module declares none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<crate::ModulePort>,
    /// The resources the module requires (provisioning; decision 0039).
    /// Absent when it requires none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<crate::Requirement>,
    /// The resource kinds the module provides, and how its server is reached.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub provides: Vec<crate::Provides>,
}

impl ModulePlacement {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        validate_module_name("body.module", &self.module)?;
        if !self.nodes.windows(2).all(|w| w[0] < w[1]) {
            return Err(DecodeError::invalid(
                "body.nodes",
                "must be sorted and without duplicates",
            ));
        }
        validate_settings_files("body.settings_files", &self.settings_files)?;
        crate::validate_ports("body.ports", &self.ports)?;
        crate::validate_resources(&self.requires, &self.provides).map_err(|e| e.prefixed("body"))
    }
}

/// Body of `inventory.module.removed`: a module was deleted. `version` is
/// above every `inventory.module.placed` of the module before it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleRemoved {
    pub module: String,
    pub version: i64,
}

impl ModuleRemoved {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        validate_module_name("body.module", &self.module)
    }
}

/// A module's placement or removal as the record tells it, for a context
/// that follows where modules run: it keeps, of each module, the newest event
/// (by `version`) and ignores older ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ModuleEvent<'a> {
    Placed(&'a ModulePlacement),
    Removed(&'a ModuleRemoved),
}

impl<'a> ModuleEvent<'a> {
    /// The module event a record event is, if it is one.
    pub fn of(kind: &'a crate::RecordKind) -> Option<ModuleEvent<'a>> {
        match kind {
            crate::RecordKind::ModulePlaced(p) => Some(ModuleEvent::Placed(p)),
            crate::RecordKind::ModuleRemoved(r) => Some(ModuleEvent::Removed(r)),
            _ => None,
        }
    }

    pub fn module(&self) -> &'a str {
        match self {
            ModuleEvent::Placed(p) => &p.module,
            ModuleEvent::Removed(r) => &r.module,
        }
    }

    pub fn version(&self) -> i64 {
        match self {
            ModuleEvent::Placed(p) => p.version,
            ModuleEvent::Removed(r) => r.version,
        }
    }

    /// The newest event of each module among `events` (the first of equal
    /// versions), by module name.
    pub fn newest(
        events: &[ModuleEvent<'a>],
    ) -> std::collections::BTreeMap<&'a str, ModuleEvent<'a>> {
        let mut newest = std::collections::BTreeMap::new();
        for e in events {
            match newest.get(e.module()) {
                Some(kept) if ModuleEvent::version(kept) >= e.version() => {}
                _ => {
                    newest.insert(e.module(), *e);
                }
            }
        }
        newest
    }

    /// The newest events of [`ModuleEvent::newest`] as the columns of one
    /// bulk statement (by module name): module, version, removed, nodes.
    pub fn columns(
        newest: &std::collections::BTreeMap<&'a str, ModuleEvent<'a>>,
    ) -> ModuleColumns<'a> {
        let n = newest.len();
        let mut c = ModuleColumns {
            modules: Vec::with_capacity(n),
            versions: Vec::with_capacity(n),
            removed: Vec::with_capacity(n),
            nodes: Vec::with_capacity(n),
        };
        for (module, e) in newest {
            c.modules.push(*module);
            c.versions.push(e.version());
            match e {
                ModuleEvent::Placed(p) => {
                    c.removed.push(false);
                    c.nodes.push(p.nodes.iter().map(NodeId::as_str).collect());
                }
                ModuleEvent::Removed(_) => {
                    c.removed.push(true);
                    c.nodes.push(Vec::new());
                }
            }
        }
        c
    }

    /// A further column of the same statement (by module name, like
    /// [`ModuleEvent::columns`]): `placed` of each placed module, the empty
    /// value for a removed one.
    pub fn column<T: Default>(
        newest: &std::collections::BTreeMap<&'a str, ModuleEvent<'a>>,
        placed: impl Fn(&ModulePlacement) -> T,
    ) -> Vec<T> {
        newest
            .values()
            .map(|e| match e {
                ModuleEvent::Placed(p) => placed(p),
                ModuleEvent::Removed(_) => T::default(),
            })
            .collect()
    }
}

/// Module events as the columns of one bulk statement ([`ModuleEvent::columns`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleColumns<'a> {
    pub modules: Vec<&'a str>,
    pub versions: Vec<i64>,
    pub removed: Vec<bool>,
    /// The nodes of a placed module; empty for a removed one.
    pub nodes: Vec<Vec<&'a str>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str) -> SettingsFile {
        SettingsFile {
            name: name.into(),
            format: SettingsFormat::Env,
        }
    }

    #[test]
    fn settings_file_names() {
        for ok in ["app.env", "A_b-1.toml", ".hidden", "x"] {
            assert!(validate_settings_file_name("f", ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(64), "é"] {
            assert!(validate_settings_file_name("f", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_files_are_bounded_and_unique() {
        let twice = [file("a"), file("a")];
        match validate_settings_files("settings_files", &twice).unwrap_err() {
            DecodeError::Invalid { field, .. } => assert_eq!(field, "settings_files[1].name"),
            other => panic!("{other}"),
        }
        let many: Vec<SettingsFile> = (0..=MAX_SETTINGS_FILES)
            .map(|i| file(&format!("f{i}")))
            .collect();
        assert!(validate_settings_files("settings_files", &many).is_err());
        assert!(validate_settings_files("settings_files", &many[1..]).is_ok());
    }

    #[test]
    fn the_newest_module_event_wins() {
        let placed = |v| ModulePlacement {
            module: "web".into(),
            version: v,
            nodes: Vec::new(),
            settings_files: Vec::new(),
            ports: Vec::new(),
            requires: Vec::new(),
            provides: Vec::new(),
        };
        let (p3, p5) = (placed(3), placed(5));
        let r4 = ModuleRemoved {
            module: "web".into(),
            version: 4,
        };
        let events = [
            ModuleEvent::Placed(&p3),
            ModuleEvent::Placed(&p5),
            ModuleEvent::Removed(&r4),
        ];
        let newest = ModuleEvent::newest(&events);
        assert_eq!(newest.len(), 1);
        assert_eq!(newest["web"], ModuleEvent::Placed(&p5));
    }

    #[test]
    fn formats_are_lowercase() {
        assert_eq!(
            serde_json::to_string(&SettingsFormat::Toml).unwrap(),
            "\"toml\""
        );
    }
}
