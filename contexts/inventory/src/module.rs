//! Modules: what operators ask the fleet to run. A module is a unit spec, a
//! stateful flag, a desired state and exactly one placement; its replica count
//! comes from intent layers (see [`crate::placement::effective_replicas`]).

use std::collections::BTreeMap;

use mesh_protocol::{
    DesiredState, MIN_PIDS, ModulePort, Probe, Provides, Requirement, RestartPolicy, RevisionUnit,
    SettingsFile, UnitItem, UnitUser, validate_ports, validate_settings_files,
};
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::placement::{Bounds, Placement, Resources};

/// How the unit of each replica runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UnitSpec {
    /// Executable: an absolute path, or a name looked up in the agent's PATH.
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    /// `always` (default), `on_failure` or `never`.
    #[serde(default)]
    pub restart: RestartPolicy,
    /// Requests of one replica; placement only puts it where they fit. They
    /// are also its limits, enforced by the agent through the unit's cgroup
    /// (with `pids`, which is a limit only); 0 is no limit.
    #[serde(default)]
    pub resources: Resources,
    /// Who the unit runs as: absent (or `module`), the module's own
    /// unprivileged user on each node; `root`, the agent's own rights, which
    /// only an admin may ask for (the change is audited as such).
    #[serde(default, skip_serializing_if = "UnitUser::is_module")]
    pub user: UnitUser,
    /// Probes the agent runs beside each replica (at most 8, names unique):
    /// HTTP GET, TCP connect or a command; their results decide the
    /// replica's health (observability).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probes: Vec<Probe>,
}

/// A module as `PUT /v1/modules/{name}` takes it and stores it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModuleSpec {
    pub unit: UnitSpec,
    /// Holds data on its node: must use `exact_node`, and is never moved.
    #[serde(default)]
    pub stateful: bool,
    /// `running` (default) or `stopped`.
    #[serde(default)]
    pub desired: DesiredState,
    pub placement: Placement,
    /// The settings files the module reads (at most 16, names unique): the
    /// config context renders the module's settings into each, at
    /// `/modules/<module>/<name>` on every node that runs the module.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settings_files: Vec<SettingsFile>,
    /// The ports the module listens on (at most 32, names and port/protocol
    /// unique): which modules may reach each over the overlay (`from`) and
    /// which are exposed publicly under a DNS name (`expose`). The
    /// connectivity context turns them into each node's packet filter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<ModulePort>,
    /// The resources the module requires (at most 32, names unique): a
    /// database, a vhost or a bucket that a provider module grants it; the
    /// credentials arrive at `/modules/<module>/secrets/grant-<name>.env` on
    /// every node that runs it (provisioning; decision 0039).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<Requirement>,
    /// The resource kinds this module's server provides (one entry per
    /// kind): where consumers reach it and how its node's agent administers it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub provides: Vec<Provides>,
    /// Where each replica serves Prometheus metrics, on its node's address:
    /// `GET /v1/prometheus/targets` lists one target per placed replica.
    /// Absent: the module serves none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<ModuleMetrics>,
}

/// A module's metrics endpoint (`metrics` of its spec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModuleMetrics {
    /// The port each replica serves metrics on (1 to 65535).
    pub port: u16,
    /// The path, starting with `/`. Default `/metrics`.
    #[serde(default = "default_metrics_path")]
    pub path: String,
}

fn default_metrics_path() -> String {
    "/metrics".to_owned()
}

/// The largest replica count any layer may ask for.
pub const MAX_REPLICAS: u32 = 1000;

/// Module names: 1 to 48 of `[a-z0-9-]`, starting with a letter or digit, and not
/// ending in `-<digits>` (unit names are `<module>-<replica>`, so `web-1` could be
/// replica 1 of `web`).
pub fn validate_name(name: &str) -> Result<(), Error> {
    let invalid = |reason: &str| Error::Invalid {
        field: "name".to_owned(),
        reason: format!("`{}`: {reason}", name.chars().take(80).collect::<String>()),
    };
    mesh_protocol::validate_module_name("name", name)?;
    if let Some((_, tail)) = name.rsplit_once('-')
        && !tail.is_empty()
        && tail.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(invalid(
            "must not end in -<digits>: replica units are named <module>-<replica>",
        ));
    }
    Ok(())
}

impl ModuleSpec {
    /// Check everything the types do not: the unit fields (as an agent would),
    /// the stateful rule, replica bounds.
    pub fn validate(&self, name: &str) -> Result<(), Error> {
        validate_name(name)?;
        let pids = self.unit.resources.pids;
        if pids != 0 && pids < MIN_PIDS {
            return Err(Error::Invalid {
                field: "unit.resources.pids".to_owned(),
                reason: format!("{pids}: at least {MIN_PIDS} (0: the agent's default limit)"),
            });
        }
        self.unit_item(name, name).validate("unit").map_err(|e| {
            // The agent's field names are the unit's: `unit.command`, ...
            Error::from(e)
        })?;
        if self.stateful && !matches!(self.placement, Placement::ExactNode { .. }) {
            return Err(Error::Invalid {
                field: "placement".to_owned(),
                reason: "a stateful module must use exact_node: its data lives on one node and it is never moved".to_owned(),
            });
        }
        validate_settings_files("settings_files", &self.settings_files)?;
        validate_ports("ports", &self.ports)?;
        if let Some(m) = &self.metrics {
            if m.port == 0 {
                return Err(Error::Invalid {
                    field: "metrics.port".to_owned(),
                    reason: "must be 1 to 65535".to_owned(),
                });
            }
            if !m.path.starts_with('/')
                || m.path.len() > 256
                || m.path.chars().any(|c| c.is_control() || c.is_whitespace())
            {
                return Err(Error::Invalid {
                    field: "metrics.path".to_owned(),
                    reason: "must start with `/`, at most 256 characters, no spaces".to_owned(),
                });
            }
        }
        mesh_protocol::validate_resources(&self.requires, &self.provides)?;
        if let Placement::MatchLabels { labels, replicas } = &self.placement {
            mesh_protocol::validate_labels("placement.match_labels.labels", labels)?;
            if *replicas > MAX_REPLICAS {
                return Err(Error::Invalid {
                    field: "placement.match_labels.replicas".to_owned(),
                    reason: format!("at most {MAX_REPLICAS}"),
                });
            }
        }
        Ok(())
    }

    /// The user intent layer: the module's own replica count.
    pub fn user_replicas(&self) -> Option<u32> {
        match &self.placement {
            Placement::MatchLabels { replicas, .. } => Some(*replicas),
            _ => None,
        }
    }

    /// Whether the unit runs as root (admin only; decision 0051).
    pub fn runs_as_root(&self) -> bool {
        self.unit.user == UnitUser::Root
    }

    /// The unit one replica runs, under the name `unit_name`: the revision
    /// delivery targets its node to, when there is one (its command, artifact
    /// and revision id), else the module's own unit. Either way the box it
    /// runs in is the module's: its limits (from `resources`), its stateful
    /// flag, and its desired state. Every unit inventory declares is made
    /// here.
    ///
    /// Root is the module spec's own unit's only: an operator makes and rolls
    /// out revisions, and an admin's `user: root` must not become the
    /// operator's way to run code of their choosing as root (decision 0051).
    /// A revision of a root module runs as the module's user.
    pub fn runs(&self, module: &str, unit_name: &str, revision: Option<&RevisionUnit>) -> UnitItem {
        let mut item = match revision {
            Some(r) => r.unit_item(module, unit_name, Some(self.desired)),
            None => self.unit_item(module, unit_name),
        };
        item.user = match revision {
            Some(_) => UnitUser::Module,
            None => self.unit.user,
        };
        item.limits = self.unit.resources.limits();
        item.stateful = self.stateful;
        item
    }

    /// The unit one replica runs from the module's own spec, under the name
    /// `unit_name` (no revision: see [`ModuleSpec::runs`]).
    pub fn unit_item(&self, module: &str, unit_name: &str) -> UnitItem {
        UnitItem {
            user: self.unit.user,
            limits: self.unit.resources.limits(),
            stateful: self.stateful,
            artifact: None,
            revision: None,
            name: unit_name.to_owned(),
            module: module.to_owned(),
            command: self.unit.command.clone(),
            args: self.unit.args.clone(),
            env: self.unit.env.clone(),
            working_dir: self.unit.working_dir.clone(),
            restart: self.unit.restart,
            desired: self.desired,
            probes: self.unit.probes.clone(),
        }
    }
}

/// The unit name of `replica` of `module`: pinned placements run one unit named
/// as the module; labelled ones `<module>-<replica>`.
pub fn unit_name(module: &str, placement: &Placement, replica: u32) -> String {
    if placement.is_pinned() {
        module.to_owned()
    } else {
        format!("{module}-{replica}")
    }
}

/// Body of `PUT /v1/modules/{name}/intent/policy`.
pub type PolicyIntent = Bounds;

/// Body of `PUT /v1/modules/{name}/intent/autoscaler`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AutoscalerIntent {
    pub replicas: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(validate_name("web").is_ok());
        assert!(validate_name("web-v2").is_ok());
        assert!(validate_name("0web").is_ok());
        assert!(validate_name("web-2").is_err());
        assert!(validate_name("Web").is_err());
        assert!(validate_name("-web").is_err());
        assert!(validate_name("").is_err());
        assert!(validate_name(&"a".repeat(49)).is_err());
    }

    #[test]
    fn settings_files_are_validated_and_absent_when_empty() {
        let spec: ModuleSpec = serde_json::from_str(
            r#"{"unit": {"command": "/bin/sleep"}, "placement": {"controller_node": {}},
                "settings_files": [{"name": "app.env", "format": "env"}, {"name": "app.env", "format": "json"}]}"#,
        )
        .unwrap();
        match spec.validate("x").unwrap_err() {
            Error::Invalid { field, .. } => assert_eq!(field, "settings_files[1].name"),
            other => panic!("{other}"),
        }
        let spec: ModuleSpec = serde_json::from_str(
            r#"{"unit": {"command": "/bin/sleep"}, "placement": {"controller_node": {}}}"#,
        )
        .unwrap();
        assert!(spec.settings_files.is_empty());
        let v = serde_json::to_value(&spec).unwrap();
        assert!(v.get("settings_files").is_none(), "{v}");
    }

    #[test]
    fn stateful_must_be_exact() {
        let spec: ModuleSpec = serde_json::from_str(
            r#"{"unit": {"command": "/bin/sleep", "args": ["100"]}, "stateful": true,
                "placement": {"match_labels": {"labels": {}, "replicas": 2}}}"#,
        )
        .unwrap();
        match spec.validate("db").unwrap_err() {
            Error::Invalid { field, .. } => assert_eq!(field, "placement"),
            other => panic!("{other}"),
        }
        let spec: ModuleSpec = serde_json::from_str(
            r#"{"unit": {"command": ""}, "placement": {"controller_node": {}}}"#,
        )
        .unwrap();
        match spec.validate("x").unwrap_err() {
            Error::Invalid { field, .. } => assert_eq!(field, "unit.command"),
            other => panic!("{other}"),
        }
    }
    #[test]
    fn the_box_is_the_modules_whatever_unit_runs() {
        let spec: ModuleSpec = serde_json::from_str(
            r#"{"unit": {"command": "/bin/sleep", "user": "root",
                         "resources": {"cpu_millis": 500, "memory_bytes": 67108864, "pids": 64}},
                "stateful": true, "placement": {"exact_node": {"node": "db-1"}}}"#,
        )
        .unwrap();
        spec.validate("db").unwrap();
        assert!(spec.runs_as_root());
        let want = mesh_protocol::UnitLimits {
            cpu_millis: Some(500),
            memory_bytes: Some(64 << 20),
            pids: Some(64),
        };
        let own = spec.runs("db", "db", None);
        assert_eq!(
            (own.user, own.limits, own.stateful),
            (UnitUser::Root, want, true)
        );
        assert_eq!(own.revision, None);
        let revision = RevisionUnit {
            id: uuid::Uuid::from_u128(7),
            artifact: None,
            command: "/usr/bin/db-v2".to_owned(),
            args: vec![],
            env: BTreeMap::new(),
            working_dir: None,
            restart: RestartPolicy::Always,
            probes: vec![],
        };
        let targeted = spec.runs("db", "db", Some(&revision));
        assert_eq!(targeted.command, "/usr/bin/db-v2");
        assert_eq!(targeted.revision, Some(revision.id));
        // A revision is an operator's: it never runs as root (decision 0051).
        assert_eq!(
            (targeted.user, targeted.limits, targeted.stateful),
            (UnitUser::Module, want, true)
        );
        targeted.validate("unit").unwrap();
        // Absent: the module's own user, no limits; and so serialized.
        let spec: ModuleSpec = serde_json::from_str(
            r#"{"unit": {"command": "/bin/sleep"}, "placement": {"controller_node": {}}}"#,
        )
        .unwrap();
        let item = spec.runs("x", "x", None);
        assert_eq!(item.user, UnitUser::Module);
        assert!(item.limits.is_empty() && !item.stateful);
        let v = serde_json::to_value(&spec).unwrap();
        assert!(v["unit"].get("user").is_none(), "{v}");
        assert!(v["unit"]["resources"].get("pids").is_none(), "{v}");
    }

    #[test]
    fn limits_below_the_smallest_are_raised_to_it_and_pids_refused() {
        let spec: ModuleSpec = serde_json::from_str(
            r#"{"unit": {"command": "/bin/sleep", "resources": {"cpu_millis": 1, "memory_bytes": 1}},
                "placement": {"controller_node": {}}}"#,
        )
        .unwrap();
        spec.validate("x").unwrap();
        let limits = spec.runs("x", "x", None).limits;
        assert_eq!(limits.cpu_millis, Some(mesh_protocol::MIN_CPU_MILLIS));
        assert_eq!(limits.memory_bytes, Some(mesh_protocol::MIN_MEMORY_BYTES));
        let spec: ModuleSpec = serde_json::from_str(
            r#"{"unit": {"command": "/bin/sleep", "resources": {"pids": 1}},
                "placement": {"controller_node": {}}}"#,
        )
        .unwrap();
        match spec.validate("x").unwrap_err() {
            Error::Invalid { field, .. } => assert_eq!(field, "unit.resources.pids"),
            other => panic!("{other}"),
        }
        let bad = serde_json::from_str::<ModuleSpec>(
            r#"{"unit": {"command": "/bin/sleep", "user": "nobody"}, "placement": {"controller_node": {}}}"#,
        );
        assert!(bad.is_err());
    }
}
