//! Manifests: the fleet's resources declared in files, read for `meshctl plan`
//! and `meshctl apply` (decision 0034).
//!
//! A manifest file is YAML (`.yaml`, `.yml`: one resource per `---` document)
//! or TOML (`.toml`: one resource at the top level, or many as `[[resource]]`
//! tables); a directory is every such file in it, in sorted order (other files,
//! such as a README or a secret's `value_file`, are not manifests). Each
//! resource has a `kind`: `Module`, `File`, `Settings`, `Secret` or `Grant`.
//!
//! Reading is strict: an unknown kind, an unknown field anywhere (nested ones
//! too) or a value of the wrong type is an error naming the file, the resource
//! (its position in the file, kind and name) and the field. What the API would
//! refuse and can be checked here (names, modes, labels, units, probes, ports,
//! settings keys and values) is refused here, before anything is read from or
//! written to the mesh. A manifest never holds a secret's value: a `Secret`
//! declares that it exists, optionally where its first value is read from
//! (`value_file`, read at apply time, never printed), and which modules it is
//! granted to.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use mesh_protocol::{
    DecodeError, DesiredState, FileMode, Labels, MIN_CPU_MILLIS, MIN_MEMORY_BYTES, MIN_PIDS,
    ModulePort, NodeId, Probe, RestartPolicy, SettingsFile, UnitItem, UnitLimits, UnitUser,
    validate_file_name, validate_labels, validate_module_name, validate_path, validate_ports,
    validate_settings_files,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

/// The kinds a manifest may declare, in the order `apply` writes them: a
/// secret exists before it is granted; a module's settings and grants are in
/// place before its first declaration, so its replicas start with them.
pub const KINDS: [&str; 5] = ["Secret", "Grant", "Settings", "File", "Module"];

/// Why a manifest cannot be used: always names the file, and the resource and
/// field when the error is in one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.render())]
pub struct ManifestError {
    pub file: String,
    /// `#2 (Module web)`: the resource's position in its file, kind and name.
    pub resource: Option<String>,
    /// A path into the resource, e.g. `unit.probes[0].interval_secs`.
    pub field: Option<String>,
    pub reason: String,
}

impl ManifestError {
    fn file(file: &Path, reason: impl Into<String>) -> Self {
        ManifestError {
            file: file.display().to_string(),
            resource: None,
            field: None,
            reason: reason.into(),
        }
    }

    fn render(&self) -> String {
        let mut out = self.file.clone();
        if let Some(r) = &self.resource {
            out.push_str(&format!(": resource {r}"));
        }
        if let Some(f) = &self.field {
            out.push_str(&format!(": field `{f}`"));
        }
        out.push_str(&format!(": {}", self.reason));
        out
    }
}

/// Where a resource was declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub file: PathBuf,
    /// 1-based position of the document (YAML) or table (TOML) in the file.
    pub index: usize,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} #{}", self.file.display(), self.index)
    }
}

/// One declared resource.
#[derive(Debug, Clone, PartialEq)]
pub struct Resource {
    pub source: Source,
    pub spec: Spec,
}

/// What a resource declares, checked and in the API's canonical form.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    Module(ModuleDoc),
    File(FileSpec),
    Settings(SettingsSpec),
    Secret(SecretSpec),
    Grant(GrantSpec),
}

// ---------------------------------------------------------------- modules ---

/// A module: `PUT /v1/modules/{name}`'s body and its name. Every field of the
/// API's `ModuleSpec`, with its defaults, so a live module read back compares
/// equal to the manifest that made it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleDoc {
    pub name: String,
    pub unit: UnitSpec,
    #[serde(default)]
    pub stateful: bool,
    #[serde(default)]
    pub desired: DesiredState,
    pub placement: Placement,
    #[serde(default)]
    pub settings_files: Vec<SettingsFile>,
    #[serde(default)]
    pub ports: Vec<ModulePort>,
}

/// The fields of [`ModuleDoc`] (besides `name`) the API's module view carries.
pub const MODULE_FIELDS: [&str; 6] = [
    "unit",
    "stateful",
    "desired",
    "placement",
    "settings_files",
    "ports",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnitSpec {
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub restart: RestartPolicy,
    #[serde(default)]
    pub resources: Resources,
    #[serde(default)]
    pub probes: Vec<Probe>,
    /// `root` (admin only) or absent: the module's own unprivileged user.
    #[serde(default, skip_serializing_if = "UnitUser::is_module")]
    pub user: UnitUser,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    #[serde(default)]
    pub cpu_millis: u64,
    #[serde(default)]
    pub memory_bytes: u64,
    /// The replica's process limit (a limit only, never placed on); 0: the
    /// agent's default.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pids: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Resources {
    /// As the controller maps them (inventory's `Resources::limits`): each
    /// request is the replica's limit, raised to the smallest an agent
    /// enforces; 0 is none.
    fn limits(&self) -> UnitLimits {
        let some = |n: u64| (n > 0).then_some(n);
        UnitLimits {
            cpu_millis: some(self.cpu_millis).map(|c| c.clamp(MIN_CPU_MILLIS, 1_024_000)),
            memory_bytes: some(self.memory_bytes).map(|m| m.max(MIN_MEMORY_BYTES)),
            pids: some(self.pids),
        }
    }
}

/// Where a module runs: exactly one of these.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Placement {
    ExactNode {
        node: String,
    },
    MatchLabels {
        #[serde(default)]
        labels: Labels,
        #[serde(default = "one")]
        replicas: u32,
    },
    ControllerNode {},
}

fn one() -> u32 {
    1
}

impl ModuleDoc {
    /// The body of `PUT /v1/modules/{name}`.
    pub fn body(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Some(m) = v.as_object_mut() {
            m.remove("name");
        }
        v
    }

    /// What the API checks and can be checked here (the inventory's rules).
    fn validate(&self) -> Result<(), DecodeError> {
        validate_module_name("name", &self.name)?;
        if let Some((_, tail)) = self.name.rsplit_once('-')
            && !tail.is_empty()
            && tail.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(inv(
                "name",
                "must not end in -<digits>: replica units are named <module>-<replica>",
            ));
        }
        if self.unit.resources.pids != 0 && self.unit.resources.pids < MIN_PIDS {
            return Err(inv(
                "unit.resources.pids",
                format!("at least {MIN_PIDS} (0: the agent's default limit)"),
            ));
        }
        UnitItem {
            user: self.unit.user,
            limits: self.unit.resources.limits(),
            stateful: self.stateful,
            name: self.name.clone(),
            module: self.name.clone(),
            command: self.unit.command.clone(),
            args: self.unit.args.clone(),
            env: self.unit.env.clone(),
            working_dir: self.unit.working_dir.clone(),
            restart: self.unit.restart,
            desired: self.desired,
            probes: self.unit.probes.clone(),
            artifact: None,
            revision: None,
        }
        .validate("unit")?;
        if self.stateful && !matches!(self.placement, Placement::ExactNode { .. }) {
            return Err(inv(
                "placement",
                "a stateful module must use exact_node: its data lives on one node and it is never moved",
            ));
        }
        match &self.placement {
            Placement::ExactNode { node } => {
                NodeId::parse(node).map_err(|e| rename(e, "placement.exact_node.node"))?;
            }
            Placement::MatchLabels { labels, replicas } => {
                validate_labels("placement.match_labels.labels", labels)?;
                if *replicas > 1000 {
                    return Err(inv("placement.match_labels.replicas", "at most 1000"));
                }
            }
            Placement::ControllerNode {} => {}
        }
        validate_settings_files("settings_files", &self.settings_files)?;
        validate_ports("ports", &self.ports)?;
        Ok(())
    }
}

// ------------------------------------------------------------------ files ---

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    name: String,
    /// Absolute path on the node.
    path: String,
    /// The file's text; or `content_file`, read relative to the manifest.
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    content_file: Option<PathBuf>,
    /// Octal string; default `"0644"`.
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    selector: Option<Labels>,
}

/// A file: `PUT /v1/files/{name}`'s body and its name.
#[derive(Debug, Clone, PartialEq)]
pub struct FileSpec {
    pub name: String,
    pub path: String,
    pub content: String,
    /// Canonical: four octal digits.
    pub mode: String,
    pub target: Target,
}

/// Which nodes a file (or a label settings layer) is for.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    Node(String),
    Selector(Labels),
}

impl FileSpec {
    pub fn body(&self) -> Value {
        let mut v = json!({"path": self.path, "content": self.content, "mode": self.mode});
        match &self.target {
            Target::Node(n) => v["node"] = json!(n),
            Target::Selector(s) => v["selector"] = json!(s),
        }
        v
    }

    /// What a live file is compared on (an absent target is null).
    pub fn comparable(v: &Value) -> Value {
        json!({
            "path": v.get("path").cloned().unwrap_or(Value::Null),
            "content": v.get("content").cloned().unwrap_or(Value::Null),
            "mode": v.get("mode").cloned().unwrap_or(Value::Null),
            "node": v.get("node").cloned().unwrap_or(Value::Null),
            "selector": v.get("selector").cloned().unwrap_or(Value::Null),
        })
    }
}

// --------------------------------------------------------------- settings ---

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum ScopeKind {
    Global,
    Labels,
    Node,
    Module,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SettingsDoc {
    /// `global`, `labels`, `node` or `module`.
    scope: ScopeKind,
    /// The label layer's name, the node id or the module name (not for `global`).
    #[serde(default)]
    name: Option<String>,
    /// Label layers only: the pairs a node's labels must contain.
    #[serde(default)]
    selector: Option<Labels>,
    values: BTreeMap<String, Value>,
}

/// A settings layer: `PUT /v1/settings/…`'s body and its scope.
#[derive(Debug, Clone, PartialEq)]
pub struct SettingsSpec {
    pub scope: Scope,
    pub values: BTreeMap<String, Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Scope {
    Global,
    Labels { name: String, selector: Labels },
    Node(String),
    Module(String),
}

impl SettingsSpec {
    /// `global`, `labels/<name>`, `nodes/<id>`, `modules/<name>`: the API path's tail.
    pub fn path(&self) -> String {
        match &self.scope {
            Scope::Global => "global".to_owned(),
            Scope::Labels { name, .. } => format!("labels/{name}"),
            Scope::Node(n) => format!("nodes/{n}"),
            Scope::Module(m) => format!("modules/{m}"),
        }
    }

    pub fn body(&self) -> Value {
        match &self.scope {
            Scope::Labels { selector, .. } => json!({"selector": selector, "values": self.values}),
            _ => json!({"values": self.values}),
        }
    }

    pub fn comparable(v: &Value) -> Value {
        let mut out = json!({"values": v.get("values").cloned().unwrap_or(json!({}))});
        if let Some(s) = v.get("selector").filter(|s| !s.is_null()) {
            out["selector"] = s.clone();
        }
        out
    }
}

/// A settings key: 1 to 128 of `A-Z a-z 0-9 _`, not starting with a digit.
fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 128
        && !k.as_bytes()[0].is_ascii_digit()
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

// ---------------------------------------------------------------- secrets ---

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretDoc {
    name: String,
    /// Where the first value is read from (relative to the manifest), at
    /// apply time, only when the secret does not exist yet.
    #[serde(default)]
    value_file: Option<PathBuf>,
    /// The modules it is granted to.
    #[serde(default)]
    grants: Vec<GrantRef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantRef {
    module: String,
    #[serde(default)]
    file: Option<String>,
}

/// A secret's metadata: that it exists, and where its first value comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct SecretSpec {
    pub name: String,
    /// Resolved against the manifest's directory; never read while planning.
    pub value_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantDoc {
    module: String,
    secret: String,
    #[serde(default)]
    file: Option<String>,
}

/// A secret granted to a module, received as `/modules/<module>/secrets/<file>`.
#[derive(Debug, Clone, PartialEq)]
pub struct GrantSpec {
    pub module: String,
    pub secret: String,
    /// Default: the secret's name.
    pub file: String,
}

fn grant(module: String, secret: &str, file: Option<String>) -> Result<GrantSpec, DecodeError> {
    validate_module_name("module", &module)?;
    let file = file.unwrap_or_else(|| secret.to_owned());
    validate_file_name("file", &file)?;
    Ok(GrantSpec {
        module,
        secret: secret.to_owned(),
        file,
    })
}

/// Files, secrets and label layers are named 1 to 63 of `a-z 0-9 . _ -`.
fn validate_name(field: &str, name: &str) -> Result<(), DecodeError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(inv(
            field,
            format!(
                "`{}`: 1 to 63 characters of a-z 0-9 . _ -",
                name.chars().take(80).collect::<String>()
            ),
        ))
    }
}

fn inv(field: impl Into<String>, reason: impl Into<String>) -> DecodeError {
    DecodeError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

fn rename(e: DecodeError, field: &str) -> DecodeError {
    match e {
        DecodeError::Invalid { reason, .. } => inv(field, reason),
        other => inv(field, other.to_string()),
    }
}

// ------------------------------------------------------------- resources ---

impl Resource {
    /// The resource's kind, as manifests spell it.
    pub fn kind(&self) -> &'static str {
        match &self.spec {
            Spec::Module(_) => "Module",
            Spec::File(_) => "File",
            Spec::Settings(_) => "Settings",
            Spec::Secret(_) => "Secret",
            Spec::Grant(_) => "Grant",
        }
    }

    /// A stable id, unique in a manifest: `module/web`, `file/motd`,
    /// `settings/labels/web-eu`, `secret/db-password`, `grant/web/db-password`.
    pub fn id(&self) -> String {
        match &self.spec {
            Spec::Module(m) => format!("module/{}", m.name),
            Spec::File(f) => format!("file/{}", f.name),
            Spec::Settings(s) => format!("settings/{}", s.path()),
            Spec::Secret(s) => format!("secret/{}", s.name),
            Spec::Grant(g) => format!("grant/{}/{}", g.module, g.secret),
        }
    }

    /// The API path of the resource (GET reads it, PUT writes it).
    pub fn api_path(&self) -> String {
        match &self.spec {
            Spec::Module(m) => format!("/v1/modules/{}", m.name),
            Spec::File(f) => format!("/v1/files/{}", f.name),
            Spec::Settings(s) => format!("/v1/settings/{}", s.path()),
            Spec::Secret(s) => format!("/v1/secrets/{}", s.name),
            Spec::Grant(g) => format!("/v1/modules/{}/grants/{}", g.module, g.secret),
        }
    }

    /// The PUT body (a secret's is its value, read at apply time: Null here).
    pub fn body(&self) -> Value {
        match &self.spec {
            Spec::Module(m) => m.body(),
            Spec::File(f) => f.body(),
            Spec::Settings(s) => s.body(),
            Spec::Secret(_) => Value::Null,
            Spec::Grant(g) => json!({"file": g.file}),
        }
    }

    /// What the resource declares, in the form a live one is compared in.
    pub fn desired(&self) -> Value {
        match &self.spec {
            Spec::File(f) => FileSpec::comparable(&f.body()),
            Spec::Settings(s) => SettingsSpec::comparable(&s.body()),
            Spec::Secret(s) => json!({"value_file": s.value_file.is_some()}),
            _ => self.body(),
        }
    }

    /// The live resource (a GET's answer) in the form [`Resource::desired`]
    /// has; an error when the answer cannot be read as this kind.
    pub fn live(&self, answer: &Value) -> Result<Value, String> {
        Ok(match &self.spec {
            Spec::Module(m) => {
                let mut picked = serde_json::Map::new();
                picked.insert("name".into(), json!(m.name));
                for k in MODULE_FIELDS {
                    if let Some(v) = answer.get(k) {
                        picked.insert(k.into(), v.clone());
                    }
                }
                let doc: ModuleDoc = serde_json::from_value(Value::Object(picked))
                    .map_err(|e| format!("the live module is not readable: {e}"))?;
                doc.body()
            }
            Spec::File(_) => {
                if answer.get("content").is_none() {
                    return Err(
                        "the answer holds no content: reading a file's content takes an operator token"
                            .to_owned(),
                    );
                }
                FileSpec::comparable(answer)
            }
            Spec::Settings(_) => SettingsSpec::comparable(answer),
            Spec::Secret(_) => self.desired(),
            Spec::Grant(_) => json!({"file": answer.get("file").cloned().unwrap_or(Value::Null)}),
        })
    }

    /// Apply order: [`KINDS`].
    pub fn rank(&self) -> usize {
        KINDS
            .iter()
            .position(|k| *k == self.kind())
            .unwrap_or(KINDS.len())
    }

    /// `Module web`, `Settings labels/web-eu`: how output names it.
    pub fn label(&self) -> String {
        match &self.spec {
            Spec::Module(m) => format!("Module {}", m.name),
            Spec::File(f) => format!("File {}", f.name),
            Spec::Settings(s) => format!("Settings {}", s.path()),
            Spec::Secret(s) => format!("Secret {}", s.name),
            Spec::Grant(g) => format!("Grant {} to {}", g.secret, g.module),
        }
    }
}

/// The digest of what resources declare (ids and canonical bodies, sorted by
/// id): a plan records it, and `apply --plan` refuses a manifest whose digest
/// differs. Formatting, comments and file layout do not change it; a secret's
/// value never enters it.
pub fn digest(resources: &[Resource]) -> String {
    let mut items: Vec<(String, String)> = resources
        .iter()
        .map(|r| (r.id(), r.desired().to_string()))
        .collect();
    items.sort();
    let mut h = Sha256::new();
    for (id, body) in items {
        h.update(id.as_bytes());
        h.update([0]);
        h.update(body.as_bytes());
        h.update([0]);
    }
    format!("sha256:{}", hex::encode(h.finalize()))
}

// ---------------------------------------------------------------- reading ---

/// Every resource of `paths` (files or directories), in order, checked; a
/// resource declared twice is an error naming both places.
pub fn load(paths: &[PathBuf]) -> Result<Vec<Resource>, ManifestError> {
    let mut files = Vec::new();
    for p in paths {
        files.extend(files_of(p)?);
    }
    let mut out: Vec<Resource> = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f)
            .map_err(|e| ManifestError::file(f, format!("cannot read it: {e}")))?;
        out.extend(parse(f, &text)?);
    }
    let mut seen: BTreeMap<String, Source> = BTreeMap::new();
    for r in &out {
        if let Some(first) = seen.insert(r.id(), r.source.clone()) {
            return Err(ManifestError {
                file: r.source.file.display().to_string(),
                resource: Some(format!("#{} ({})", r.source.index, r.label())),
                field: None,
                reason: format!("declared twice: first at {first}"),
            });
        }
    }
    // A module may receive a file name once: two grants of one module naming
    // one file would fail half-way through an apply.
    let mut files_of_module: BTreeMap<(String, String), String> = BTreeMap::new();
    for r in &out {
        if let Spec::Grant(g) = &r.spec
            && let Some(other) =
                files_of_module.insert((g.module.clone(), g.file.clone()), g.secret.clone())
        {
            return Err(ManifestError {
                file: r.source.file.display().to_string(),
                resource: Some(format!("#{} ({})", r.source.index, r.label())),
                field: Some("file".into()),
                reason: format!(
                    "module `{}` already receives secret `{other}` as file `{}`",
                    g.module, g.file
                ),
            });
        }
    }
    if out.is_empty() {
        let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        return Err(ManifestError {
            file: names.join(", "),
            resource: None,
            field: None,
            reason:
                "no resource declared (a directory's manifests are its .yaml, .yml and .toml files)"
                    .into(),
        });
    }
    Ok(out)
}

/// The manifest files `path` names: itself, or a directory's `.yaml`, `.yml`
/// and `.toml` files in sorted order.
fn files_of(path: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| ManifestError::file(path, format!("cannot read it: {e}")))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    let entries = std::fs::read_dir(path)
        .map_err(|e| ManifestError::file(path, format!("cannot list it: {e}")))?;
    for e in entries {
        let e = e.map_err(|e| ManifestError::file(path, format!("cannot list it: {e}")))?;
        let p = e.path();
        if p.is_file() && format_of(&p).is_some() {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Yaml,
    Toml,
}

fn format_of(p: &Path) -> Option<Format> {
    match p.extension().and_then(|e| e.to_str()) {
        Some("yaml" | "yml") => Some(Format::Yaml),
        Some("toml") => Some(Format::Toml),
        _ => None,
    }
}

/// The resources of one file's `text`.
pub fn parse(file: &Path, text: &str) -> Result<Vec<Resource>, ManifestError> {
    let format = format_of(file)
        .ok_or_else(|| ManifestError::file(file, "a manifest is a .yaml, .yml or .toml file"))?;
    let docs = match format {
        Format::Yaml => yaml_documents(file, text)?,
        Format::Toml => toml_documents(file, text)?,
    };
    let dir = file.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for (i, doc) in docs.into_iter().enumerate() {
        let source = Source {
            file: file.to_owned(),
            index: i + 1,
        };
        out.extend(resource(&source, dir, doc)?);
    }
    Ok(out)
}

fn yaml_documents(file: &Path, text: &str) -> Result<Vec<Value>, ManifestError> {
    let mut docs = Vec::new();
    for (i, de) in serde_norway::Deserializer::from_str(text).enumerate() {
        let v = Value::deserialize(de).map_err(|e| ManifestError {
            file: file.display().to_string(),
            resource: Some(format!("#{}", i + 1)),
            field: None,
            reason: format!("not YAML a manifest can hold: {e}"),
        })?;
        // An empty document (a trailing `---`, a file of comments) declares nothing.
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn toml_documents(file: &Path, text: &str) -> Result<Vec<Value>, ManifestError> {
    let v: Value = toml::from_str(text)
        .map_err(|e| ManifestError::file(file, format!("not TOML: {}", e.to_string().trim())))?;
    let Value::Object(mut top) = v else {
        return Err(ManifestError::file(file, "not a TOML table"));
    };
    if top.contains_key("kind") {
        return Ok(vec![Value::Object(top)]);
    }
    let many = top.remove("resource");
    if let Some(other) = top.keys().next() {
        return Err(ManifestError {
            file: file.display().to_string(),
            resource: None,
            field: Some(other.clone()),
            reason: "unknown top-level key: a TOML manifest is one resource (with `kind`) or `[[resource]]` tables".into(),
        });
    }
    match many {
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(ManifestError {
            file: file.display().to_string(),
            resource: None,
            field: Some("resource".into()),
            reason: "must be an array of tables: `[[resource]]`".into(),
        }),
        None => Ok(Vec::new()),
    }
}

/// Deserialize `v` as `T`: a wrong type names its path; a field nobody reads
/// (an unknown one, nested ones too) is an error naming it.
fn typed<T: DeserializeOwned>(v: Value) -> Result<T, (Option<String>, String)> {
    let mut unknown: Vec<String> = Vec::new();
    let t = {
        let mut note = |path: serde_ignored::Path| unknown.push(field_of(&path));
        let de = serde_ignored::Deserializer::new(v, &mut note);
        serde_path_to_error::deserialize::<_, T>(de).map_err(|e| {
            let path = e.path().to_string();
            let field = (path != ".").then_some(path);
            (field, e.into_inner().to_string())
        })?
    };
    if let Some(path) = unknown.into_iter().next() {
        return Err((Some(path), "unknown field".to_owned()));
    }
    Ok(t)
}

/// `unit.probes[0].name`: a path as `serde_path_to_error` spells it.
fn field_of(p: &serde_ignored::Path) -> String {
    use serde_ignored::Path;
    match p {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", field_of(parent)),
        Path::Map { parent, key } => {
            let parent = field_of(parent);
            if parent.is_empty() {
                key.clone()
            } else {
                format!("{parent}.{key}")
            }
        }
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => field_of(parent),
    }
}

/// One document: its resources (a `Secret` with `grants` is several).
fn resource(source: &Source, dir: &Path, doc: Value) -> Result<Vec<Resource>, ManifestError> {
    let Value::Object(mut map) = doc else {
        return Err(ManifestError {
            file: source.file.display().to_string(),
            resource: Some(format!("#{}", source.index)),
            field: None,
            reason: "a resource is a map with a `kind`".into(),
        });
    };
    let name = map
        .get("name")
        .or_else(|| map.get("scope"))
        .and_then(Value::as_str)
        .map(|s| s.chars().take(80).collect::<String>());
    let kind = map.remove("kind");
    let kind_text = kind.as_ref().and_then(Value::as_str).map(str::to_owned);
    let label = match (&kind_text, &name) {
        (Some(k), Some(n)) => format!("#{} ({k} {n})", source.index),
        (Some(k), None) => format!("#{} ({k})", source.index),
        _ => format!("#{}", source.index),
    };
    let err = |field: Option<String>, reason: String| ManifestError {
        file: source.file.display().to_string(),
        resource: Some(label.clone()),
        field,
        reason,
    };
    let invalid = |e: DecodeError| match e {
        DecodeError::Invalid { field, reason } => err(Some(field), reason),
        other => err(None, other.to_string()),
    };
    let Some(kind) = kind_text else {
        return Err(err(
            Some("kind".into()),
            format!(
                "{}: one of {}",
                if kind.is_some() {
                    "must be a string"
                } else {
                    "missing"
                },
                KINDS.join(", ")
            ),
        ));
    };
    let body = Value::Object(map);
    let one = |spec: Spec| {
        vec![Resource {
            source: source.clone(),
            spec,
        }]
    };
    match kind.as_str() {
        "Module" => {
            let doc: ModuleDoc = typed(body).map_err(|(f, r)| err(f, r))?;
            doc.validate().map_err(invalid)?;
            Ok(one(Spec::Module(doc)))
        }
        "File" => {
            let doc: FileDoc = typed(body).map_err(|(f, r)| err(f, r))?;
            validate_name("name", &doc.name).map_err(invalid)?;
            let content = match (doc.content, doc.content_file) {
                (Some(c), None) => c,
                (None, Some(p)) => {
                    let p = dir.join(p);
                    std::fs::read_to_string(&p).map_err(|e| {
                        err(
                            Some("content_file".into()),
                            format!("cannot read {}: {e}", p.display()),
                        )
                    })?
                }
                (Some(_), Some(_)) => {
                    return Err(err(
                        Some("content_file".into()),
                        "give exactly one of `content` and `content_file`, not both".into(),
                    ));
                }
                (None, None) => {
                    return Err(err(
                        Some("content".into()),
                        "missing: give `content` (the text) or `content_file` (a path relative to the manifest)".into(),
                    ));
                }
            };
            let mode = FileMode::parse_octal(doc.mode.as_deref().unwrap_or("0644"))
                .map_err(invalid)?
                .to_string();
            validate_path("path", &doc.path).map_err(invalid)?;
            if doc.path.starts_with("/modules/") || doc.path == "/modules" {
                return Err(err(
                    Some("path".into()),
                    "paths under /modules/ are modules' settings files and secrets".into(),
                ));
            }
            let target = match (doc.node, doc.selector) {
                (Some(n), None) => {
                    NodeId::parse(&n).map_err(|e| invalid(rename(e, "node")))?;
                    Target::Node(n)
                }
                (None, Some(s)) => {
                    validate_labels("selector", &s).map_err(invalid)?;
                    Target::Selector(s)
                }
                (Some(_), Some(_)) => {
                    return Err(err(
                        Some("selector".into()),
                        "give exactly one of `node` and `selector`, not both".into(),
                    ));
                }
                (None, None) => {
                    return Err(err(
                        Some("node".into()),
                        "missing: give `node` (a node id) or `selector` (a label map; {} is every node)".into(),
                    ));
                }
            };
            Ok(one(Spec::File(FileSpec {
                name: doc.name,
                path: doc.path,
                content,
                mode,
                target,
            })))
        }
        "Settings" => {
            let doc: SettingsDoc = typed(body).map_err(|(f, r)| err(f, r))?;
            let named = |what: &str| -> Result<String, ManifestError> {
                doc.name.clone().ok_or_else(|| {
                    err(
                        Some("name".into()),
                        format!("missing: a {} layer names {what}", scope_word(doc.scope)),
                    )
                })
            };
            if doc.scope != ScopeKind::Labels && doc.selector.is_some() {
                return Err(err(
                    Some("selector".into()),
                    "only a `labels` layer has a selector".into(),
                ));
            }
            let scope = match doc.scope {
                ScopeKind::Global => {
                    if doc.name.is_some() {
                        return Err(err(
                            Some("name".into()),
                            "the global layer has no name".into(),
                        ));
                    }
                    Scope::Global
                }
                ScopeKind::Labels => {
                    let name = named("itself")?;
                    validate_name("name", &name).map_err(invalid)?;
                    let selector = doc.selector.clone().ok_or_else(|| {
                        err(
                            Some("selector".into()),
                            "missing: a labels layer applies to the nodes whose labels contain its selector ({} is every node)".into(),
                        )
                    })?;
                    validate_labels("selector", &selector).map_err(invalid)?;
                    Scope::Labels { name, selector }
                }
                ScopeKind::Node => {
                    let name = named("a node")?;
                    NodeId::parse(&name).map_err(|e| invalid(rename(e, "name")))?;
                    Scope::Node(name)
                }
                ScopeKind::Module => {
                    let name = named("a module")?;
                    validate_module_name("name", &name).map_err(invalid)?;
                    Scope::Module(name)
                }
            };
            if doc.values.len() > 256 {
                return Err(err(
                    Some("values".into()),
                    "at most 256 keys a layer".into(),
                ));
            }
            for (k, v) in &doc.values {
                if !valid_key(k) {
                    return Err(err(
                        Some(format!("values.{k}")),
                        "keys are 1 to 128 of A-Z a-z 0-9 _, not starting with a digit".into(),
                    ));
                }
                if !(v.is_string() || v.is_number() || v.is_boolean()) {
                    return Err(err(
                        Some(format!("values.{k}")),
                        "a value is a string, a number or a boolean".into(),
                    ));
                }
            }
            Ok(one(Spec::Settings(SettingsSpec {
                scope,
                values: doc.values,
            })))
        }
        "Secret" => {
            let doc: SecretDoc = typed(body).map_err(|(f, r)| err(f, r))?;
            validate_name("name", &doc.name).map_err(invalid)?;
            let mut out = one(Spec::Secret(SecretSpec {
                name: doc.name.clone(),
                value_file: doc.value_file.map(|p| dir.join(p)),
            }));
            let mut modules = BTreeSet::new();
            for (i, g) in doc.grants.into_iter().enumerate() {
                if !modules.insert(g.module.clone()) {
                    return Err(err(
                        Some(format!("grants[{i}].module")),
                        format!("module `{}` is granted it twice", g.module),
                    ));
                }
                let g = grant(g.module, &doc.name, g.file)
                    .map_err(|e| invalid(prefix(e, &format!("grants[{i}]"))))?;
                out.push(Resource {
                    source: source.clone(),
                    spec: Spec::Grant(g),
                });
            }
            Ok(out)
        }
        "Grant" => {
            let doc: GrantDoc = typed(body).map_err(|(f, r)| err(f, r))?;
            validate_name("secret", &doc.secret).map_err(invalid)?;
            let g = grant(doc.module, &doc.secret, doc.file).map_err(invalid)?;
            Ok(one(Spec::Grant(g)))
        }
        other => Err(err(
            Some("kind".into()),
            format!(
                "unknown kind `{}`: one of {}",
                other.chars().take(40).collect::<String>(),
                KINDS.join(", ")
            ),
        )),
    }
}

fn scope_word(s: ScopeKind) -> &'static str {
    match s {
        ScopeKind::Global => "global",
        ScopeKind::Labels => "labels",
        ScopeKind::Node => "node",
        ScopeKind::Module => "module",
    }
}

fn prefix(e: DecodeError, p: &str) -> DecodeError {
    match e {
        DecodeError::Invalid { field, reason } => inv(format!("{p}.{field}"), reason),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(text: &str) -> Result<Vec<Resource>, ManifestError> {
        parse(Path::new("m/test.yaml"), text)
    }

    fn toml_(text: &str) -> Result<Vec<Resource>, ManifestError> {
        parse(Path::new("m/test.toml"), text)
    }

    #[test]
    fn yaml_documents_are_resources_in_order() {
        let rs = yaml(
            "kind: File\nname: motd\npath: /etc/motd\ncontent: hi\nselector: {role: web}\n---\n\
             kind: Settings\nscope: global\nvalues: {PORT: 8080, DEBUG: false}\n---\n",
        )
        .unwrap();
        assert_eq!(rs.len(), 2);
        assert_eq!(rs[0].id(), "file/motd");
        assert_eq!(rs[0].source.index, 1);
        assert_eq!(
            rs[0].body(),
            json!({"path": "/etc/motd", "content": "hi", "mode": "0644", "selector": {"role": "web"}})
        );
        assert_eq!(rs[1].id(), "settings/global");
        assert_eq!(rs[1].api_path(), "/v1/settings/global");
        assert_eq!(
            rs[1].body(),
            json!({"values": {"PORT": 8080, "DEBUG": false}})
        );
    }

    #[test]
    fn toml_is_one_resource_or_an_array_of_tables() {
        let rs = toml_("kind = \"Grant\"\nmodule = \"web\"\nsecret = \"db-password\"\n").unwrap();
        assert_eq!(rs[0].id(), "grant/web/db-password");
        assert_eq!(rs[0].body(), json!({"file": "db-password"}));
        let rs = toml_(
            "[[resource]]\nkind = \"Settings\"\nscope = \"labels\"\nname = \"web-eu\"\n\
             selector = { role = \"web\" }\nvalues = { LOG_LEVEL = \"debug\" }\n\n\
             [[resource]]\nkind = \"Settings\"\nscope = \"node\"\nname = \"web-1\"\nvalues = {}\n",
        )
        .unwrap();
        assert_eq!(rs.len(), 2);
        assert_eq!(rs[0].api_path(), "/v1/settings/labels/web-eu");
        assert_eq!(
            rs[0].body(),
            json!({"selector": {"role": "web"}, "values": {"LOG_LEVEL": "debug"}})
        );
        assert_eq!(rs[1].api_path(), "/v1/settings/nodes/web-1");
        assert_eq!(rs[1].source.index, 2);
        let e = toml_("[[resources]]\nkind = \"Grant\"\n").unwrap_err();
        assert_eq!(e.field.as_deref(), Some("resources"), "{e}");
    }

    #[test]
    fn a_module_takes_the_apis_defaults() {
        let rs = yaml(
            "kind: Module\nname: web\nunit: {command: /bin/sleep, args: [infinity]}\n\
             placement: {match_labels: {labels: {role: web}}}\n",
        )
        .unwrap();
        assert_eq!(
            rs[0].body(),
            json!({
                "unit": {"command": "/bin/sleep", "args": ["infinity"], "env": {}, "working_dir": null,
                         "restart": "always", "resources": {"cpu_millis": 0, "memory_bytes": 0}, "probes": []},
                "stateful": false, "desired": "running",
                "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": 1}},
                "settings_files": [], "ports": []
            })
        );
        // The API's view (defaults skipped, extra fields) reads back equal.
        let live = json!({
            "name": "web", "revision": 3, "assignments": [],
            "unit": {"command": "/bin/sleep", "args": ["infinity"], "env": {}, "restart": "always",
                     "resources": {"cpu_millis": 0, "memory_bytes": 0}},
            "stateful": false, "desired": "running",
            "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": 1}},
        });
        assert_eq!(rs[0].live(&live).unwrap(), rs[0].desired());
    }

    #[test]
    fn a_module_may_run_as_root_with_a_pids_limit() {
        let rs = yaml(
            "kind: Module\nname: db\nstateful: true\n\
             unit: {command: /bin/sleep, user: root, resources: {memory_bytes: 67108864, pids: 32}}\n\
             placement: {exact_node: {node: db-1}}\n",
        )
        .unwrap();
        let body = rs[0].body();
        assert_eq!(body["unit"]["user"], "root");
        assert_eq!(
            body["unit"]["resources"],
            json!({"cpu_millis": 0, "memory_bytes": 67108864, "pids": 32})
        );
        let live = json!({
            "name": "db", "stateful": true, "desired": "running",
            "unit": {"command": "/bin/sleep", "user": "root",
                     "resources": {"cpu_millis": 0, "memory_bytes": 67108864, "pids": 32}},
            "placement": {"exact_node": {"node": "db-1"}},
        });
        assert_eq!(rs[0].live(&live).unwrap(), rs[0].desired());
        let e = error_of(yaml(
            "kind: Module\nname: db\nunit: {command: /bin/sleep, resources: {pids: 1}}\n\
             placement: {controller_node: {}}\n",
        ));
        assert_eq!(e.field.as_deref(), Some("unit.resources.pids"), "{e}");
        let e = error_of(yaml(
            "kind: Module\nname: db\nunit: {command: /bin/sleep, user: nobody}\n\
             placement: {controller_node: {}}\n",
        ));
        assert!(e.to_string().contains("user"), "{e}");
    }

    fn error_of(r: Result<Vec<Resource>, ManifestError>) -> ManifestError {
        match r {
            Ok(rs) => panic!("accepted: {rs:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn unknown_fields_are_errors_naming_file_resource_and_field() {
        let e = error_of(yaml(
            "kind: File\nname: motd\npath: /etc/motd\ncontent: hi\nnode: n1\n---\n\
             kind: Module\nname: web\nunit: {command: x, probes: [{name: p, tcp: {port: 80}, bogus: 1}]}\n\
             placement: {controller_node: {}}\n",
        ));
        assert_eq!(e.file, "m/test.yaml");
        assert_eq!(e.resource.as_deref(), Some("#2 (Module web)"));
        assert_eq!(e.field.as_deref(), Some("unit.probes[0].bogus"), "{e}");
        assert_eq!(
            e.to_string(),
            "m/test.yaml: resource #2 (Module web): field `unit.probes[0].bogus`: unknown field"
        );
        let e = error_of(yaml(
            "kind: File\nname: motd\npath: /etc/motd\ncontent: hi\nnode: n1\ncolour: red\n",
        ));
        assert_eq!(e.resource.as_deref(), Some("#1 (File motd)"));
        assert!(e.to_string().contains("colour"), "{e}");
        let e = error_of(toml_(
            "kind = \"Settings\"\nscope = \"global\"\nvalues = {}\nselectr = {}\n",
        ));
        assert!(e.to_string().contains("selectr"), "{e}");
    }

    #[test]
    fn wrong_types_and_values_name_the_field() {
        let e = error_of(yaml(
            "kind: Module\nname: web\nunit: {command: x, restart: sometimes}\nplacement: {controller_node: {}}\n",
        ));
        assert_eq!(e.field.as_deref(), Some("unit.restart"), "{e}");
        let e = error_of(yaml(
            "kind: File\nname: motd\npath: /etc/motd\ncontent: hi\nmode: \"999\"\nnode: n1\n",
        ));
        assert_eq!(e.field.as_deref(), Some("mode"), "{e}");
        let e = error_of(yaml(
            "kind: File\nname: motd\npath: /etc/motd\ncontent: hi\n",
        ));
        assert_eq!(e.field.as_deref(), Some("node"), "{e}");
        let e = error_of(yaml(
            "kind: Settings\nscope: global\nvalues: {PORT: [1, 2]}\n",
        ));
        assert_eq!(e.field.as_deref(), Some("values.PORT"), "{e}");
        let e = error_of(yaml(
            "kind: Module\nname: db\nstateful: true\nunit: {command: x}\nplacement: {match_labels: {}}\n",
        ));
        assert_eq!(e.field.as_deref(), Some("placement"), "{e}");
        let e = error_of(yaml("kind: Secret\nname: pw\ngrants: [{module: Web}]\n"));
        assert_eq!(e.field.as_deref(), Some("grants[0].module"), "{e}");
    }

    #[test]
    fn unknown_kind_and_bad_syntax() {
        let e = error_of(yaml("kind: Deployment\nname: web\n"));
        assert_eq!(e.field.as_deref(), Some("kind"));
        assert!(e.to_string().contains("unknown kind `Deployment`"), "{e}");
        assert!(e.to_string().contains("#1 (Deployment web)"), "{e}");
        let e = error_of(yaml("name: web\n"));
        assert_eq!(e.field.as_deref(), Some("kind"));
        let e = error_of(yaml("kind: File\n---\nkind: [unclosed\n"));
        assert_eq!(e.file, "m/test.yaml");
        assert!(
            e.to_string().contains("line"),
            "a syntax error says where: {e}"
        );
        let e = error_of(toml_("kind = \n"));
        assert!(e.to_string().starts_with("m/test.toml: not TOML"), "{e}");
        let e = error_of(parse(Path::new("m/test.json"), "{}"));
        assert!(e.to_string().contains(".yaml"), "{e}");
    }

    #[test]
    fn a_secret_declares_its_grants_and_never_a_value() {
        let rs = yaml(
            "kind: Secret\nname: db-password\nvalue_file: pw.txt\ngrants: [{module: web}, {module: api, file: db.pass}]\n",
        )
        .unwrap();
        let ids: Vec<String> = rs.iter().map(Resource::id).collect();
        assert_eq!(
            ids,
            [
                "secret/db-password",
                "grant/web/db-password",
                "grant/api/db-password"
            ]
        );
        let Spec::Secret(s) = &rs[0].spec else {
            panic!("not a secret")
        };
        assert_eq!(s.value_file.as_deref(), Some(Path::new("m/pw.txt")));
        assert_eq!(rs[2].body(), json!({"file": "db.pass"}));
        let e = error_of(yaml("kind: Secret\nname: pw\nvalue: hunter2\n"));
        assert_eq!(e.field.as_deref(), Some("value"));
        assert!(e.to_string().contains("unknown field `value`"), "{e}");
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    #[test]
    fn duplicates_and_digests() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        let b = dir.path().join("b.toml");
        std::fs::write(&a, "kind: Settings\nscope: global\nvalues: {A: 1}\n").unwrap();
        std::fs::write(
            &b,
            "kind = \"Settings\"\nscope = \"global\"\nvalues = { A = 1 }\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("README.md"), "not a manifest").unwrap();
        let e = load(&[dir.path().to_owned()]).unwrap_err();
        assert!(e.to_string().contains("declared twice"), "{e}");
        std::fs::remove_file(&b).unwrap();
        let one = load(&[dir.path().to_owned()]).unwrap();
        // The same resource in another format (or with comments) digests the same.
        std::fs::write(
            &a,
            "# global\nkind: Settings\nvalues:\n  A: 1\nscope: global\n",
        )
        .unwrap();
        let same = load(std::slice::from_ref(&a)).unwrap();
        assert_eq!(digest(&one), digest(&same));
        std::fs::write(&a, "kind: Settings\nscope: global\nvalues: {A: 2}\n").unwrap();
        assert_ne!(digest(&one), digest(&load(&[a]).unwrap()));
        let empty = tempfile::tempdir().unwrap();
        assert!(load(&[empty.path().to_owned()]).is_err());
    }

    #[test]
    fn content_file_is_read_relative_to_the_manifest() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("motd.txt"), "hello\n").unwrap();
        let m = dir.path().join("f.yaml");
        std::fs::write(&m, "kind: File\nname: motd\npath: /etc/motd\ncontent_file: motd.txt\nmode: \"600\"\nnode: n1\n").unwrap();
        let rs = load(&[m]).unwrap();
        assert_eq!(
            rs[0].body(),
            json!({"path": "/etc/motd", "content": "hello\n", "mode": "0600", "node": "n1"})
        );
    }
}
