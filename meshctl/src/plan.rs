//! `meshctl plan` and `meshctl apply`: a manifest's resources compared with
//! the live mesh, and written with the ETags the comparison read (decision 0034).
//!
//! `plan` reads every declared resource (`GET`, keeping its ETag), the nodes
//! and the modules' assignments, and prints per resource what `apply` would
//! do (create, update with the changed fields, unchanged; a secret that does
//! not exist and has no `value_file` is *missing*) and the nodes the change
//! reaches. `--out` saves the plan: each resource's action and ETag, the API
//! and the manifest's digest. `apply --plan` refuses a plan made from another
//! manifest or against another API, checks that every resource is still at the
//! ETag the plan read (nothing is written otherwise), then writes each change
//! with `If-Match: <ETag>` (`If-None-Match: *` for a create): a change made by
//! someone else in between fails with 412 (exit 7) instead of being
//! overwritten. Without `--plan`, `apply` plans, prints the plan and applies it
//! the same way. Apply never deletes: a resource left out of a manifest stays.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use crate::client::{Api, ApiError};
use crate::manifest::{self, Placement, Resource, Scope, Spec, Target};

/// What a plan file says it is.
const PLAN_FORMAT: &str = "meshctl-plan/1";

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Exit codes: 0 planned (with --detailed-exitcode: no changes), 1 error (a manifest error names its file, resource and field), 2 changes (with --detailed-exitcode)."
)]
pub struct PlanArgs {
    /// Manifest files or directories (a directory: its .yaml, .yml and .toml
    /// files, sorted). Repeatable.
    #[arg(short = 'f', long = "filename", required = true)]
    pub files: Vec<PathBuf>,
    /// Exit 2 when the plan has changes (0: none).
    #[arg(long)]
    pub detailed_exitcode: bool,
    /// Save the plan (each resource's ETag, the manifest's digest) for
    /// `meshctl apply --plan`.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Exit codes: 0 applied, 1 error (nothing after it was written), 7 a resource changed since it was planned (412: it was not overwritten; plan again). With --dry-run, plan's: 2 changes with --detailed-exitcode."
)]
pub struct ApplyArgs {
    /// Manifest files or directories (a directory: its .yaml, .yml and .toml
    /// files, sorted). Repeatable.
    #[arg(short = 'f', long = "filename", required = true)]
    pub files: Vec<PathBuf>,
    /// Apply this saved plan (`meshctl plan --out`) with the ETags it read;
    /// refused if it was made from another manifest.
    #[arg(long, conflicts_with = "dry_run")]
    pub plan: Option<PathBuf>,
    /// Only plan (as `meshctl plan`).
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: exit 2 when the plan has changes.
    #[arg(long, requires = "dry_run")]
    pub detailed_exitcode: bool,
    /// With --dry-run: save the plan.
    #[arg(long, requires = "dry_run")]
    pub out: Option<PathBuf>,
}

/// What apply does to one resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Create,
    Update,
    Unchanged,
    /// A secret that does not exist and whose manifest gives no `value_file`:
    /// apply refuses until it is set.
    Missing,
}

/// One field that differs: its path and both values.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub field: String,
    pub from: Value,
    pub to: Value,
}

/// One resource's part of a plan.
#[derive(Debug, Clone)]
pub struct Step {
    pub resource: Resource,
    pub action: Action,
    /// The ETag read (none: the resource does not exist).
    pub etag: Option<String>,
    pub changes: Vec<Change>,
    pub reach: Reach,
}

/// The nodes a change reaches, and what the list cannot say.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reach {
    pub nodes: BTreeSet<String>,
    pub note: Option<String>,
}

/// The fields of `desired` that differ from `live`: objects compared key by
/// key (a key one side lacks is null there), anything else whole.
pub fn diff(live: &Value, desired: &Value) -> Vec<Change> {
    let mut out = Vec::new();
    walk("", live, desired, &mut out);
    out
}

fn walk(path: &str, live: &Value, desired: &Value, out: &mut Vec<Change>) {
    match (live, desired) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let sub = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                walk(
                    &sub,
                    a.get(k).unwrap_or(&Value::Null),
                    b.get(k).unwrap_or(&Value::Null),
                    out,
                );
            }
        }
        (a, b) if a != b => out.push(Change {
            field: if path.is_empty() {
                ".".into()
            } else {
                path.into()
            },
            from: a.clone(),
            to: b.clone(),
        }),
        _ => {}
    }
}

/// A value as a plan prints it: short ones whole, long or multi-line text as
/// its size and digest.
pub fn short(v: &Value) -> String {
    match v {
        Value::Null => "(none)".into(),
        Value::String(s) if s.len() > 60 || s.contains('\n') => format!(
            "<{} bytes, sha256:{}>",
            s.len(),
            &hex::encode(Sha256::digest(s.as_bytes()))[..12]
        ),
        other => {
            let text = other.to_string();
            if text.chars().count() > 100 {
                format!("{}…", text.chars().take(100).collect::<String>())
            } else {
                text
            }
        }
    }
}

// ------------------------------------------------------------ the fleet ---

#[derive(Debug, Clone, Default)]
pub struct Fleet {
    /// Node id → (effective labels, state).
    pub nodes: BTreeMap<String, (BTreeMap<String, String>, String)>,
    /// Module → the nodes its replicas are assigned to.
    pub assigned: BTreeMap<String, BTreeSet<String>>,
    /// Modules that declare settings files (live or in the manifest).
    pub with_settings: BTreeSet<String>,
}

impl Fleet {
    async fn read(api: &Api) -> anyhow::Result<Fleet> {
        let mut fleet = Fleet::default();
        for node in pages(api, "/v1/nodes", "nodes").await? {
            let Some(id) = node.get("id").and_then(Value::as_str) else {
                continue;
            };
            let labels = serde_json::from_value(node.get("labels").cloned().unwrap_or_default())
                .unwrap_or_default();
            let state = node
                .get("state")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_owned();
            fleet.nodes.insert(id.to_owned(), (labels, state));
        }
        for m in pages(api, "/v1/modules", "modules").await? {
            let Some(name) = m.get("name").and_then(Value::as_str) else {
                continue;
            };
            let nodes = m
                .get("assignments")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|a| a.get("node").and_then(Value::as_str).map(str::to_owned))
                .collect();
            fleet.assigned.insert(name.to_owned(), nodes);
            if m.get("settings_files")
                .and_then(Value::as_array)
                .is_some_and(|f| !f.is_empty())
            {
                fleet.with_settings.insert(name.to_owned());
            }
        }
        Ok(fleet)
    }

    /// Nodes (not revoked) whose labels contain every pair of `selector`.
    fn matching(&self, selector: &BTreeMap<String, String>) -> BTreeSet<String> {
        self.nodes
            .iter()
            .filter(|(_, (labels, state))| {
                state != "revoked" && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
            })
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Where a module runs now, or would run once placed.
    fn module_nodes(&self, name: &str, manifest: &[Resource]) -> Reach {
        let now = self.assigned.get(name).cloned().unwrap_or_default();
        let declared = manifest.iter().find_map(|r| match &r.spec {
            Spec::Module(m) if m.name == name => Some(m),
            _ => None,
        });
        let Some(m) = declared else {
            return Reach {
                nodes: now,
                note: None,
            };
        };
        let mut reach = Reach {
            nodes: now,
            note: None,
        };
        match &m.placement {
            Placement::ExactNode { node } => {
                if !self.nodes.contains_key(node) {
                    reach.note = Some(format!("node `{node}` is not known (yet)"));
                }
                reach.nodes.insert(node.clone());
            }
            Placement::MatchLabels { labels, replicas } => {
                let alive: BTreeSet<String> = self
                    .matching(labels)
                    .into_iter()
                    .filter(|n| self.nodes.get(n).is_some_and(|(_, s)| s == "alive"))
                    .collect();
                if alive.len() > *replicas as usize {
                    reach.note = Some(format!(
                        "{replicas} replica(s) placed among {} alive matching nodes",
                        alive.len()
                    ));
                } else if alive.len() < *replicas as usize {
                    reach.note = Some(format!(
                        "{replicas} replica(s) asked, {} alive matching node(s)",
                        alive.len()
                    ));
                }
                reach.nodes.extend(alive);
            }
            Placement::ControllerNode {} => {
                if reach.nodes.is_empty() {
                    reach.note = Some("the controller's node".into());
                }
            }
        }
        reach
    }

    /// The nodes a resource's change reaches.
    pub fn reach(&self, r: &Resource, manifest: &[Resource]) -> Reach {
        let with_settings = |m: &str| {
            self.with_settings.contains(m)
                || manifest.iter().any(|r| {
                    matches!(&r.spec, Spec::Module(d) if d.name == m && !d.settings_files.is_empty())
                })
        };
        // Nodes that render some module's settings files.
        let rendering = || -> BTreeSet<String> {
            let mut modules: BTreeSet<&str> = self.assigned.keys().map(String::as_str).collect();
            for r in manifest {
                if let Spec::Module(m) = &r.spec {
                    modules.insert(&m.name);
                }
            }
            modules
                .into_iter()
                .filter(|m| with_settings(m))
                .flat_map(|m| self.module_nodes(m, manifest).nodes)
                .collect()
        };
        match &r.spec {
            Spec::Module(m) => self.module_nodes(&m.name, manifest),
            Spec::File(f) => match &f.target {
                Target::Node(n) => Reach {
                    nodes: BTreeSet::from([n.clone()]),
                    note: (!self.nodes.contains_key(n)).then(|| {
                        format!("node `{n}` is not known yet: it gets the file when it joins")
                    }),
                },
                Target::Selector(s) => Reach {
                    nodes: self.matching(s),
                    note: None,
                },
            },
            Spec::Settings(s) => {
                let nodes: BTreeSet<String> = match &s.scope {
                    Scope::Global => rendering(),
                    Scope::Labels { selector, .. } => {
                        let m = self.matching(selector);
                        rendering().intersection(&m).cloned().collect()
                    }
                    Scope::Node(n) => rendering().into_iter().filter(|x| x == n).collect(),
                    Scope::Module(m) if with_settings(m) => self.module_nodes(m, manifest).nodes,
                    Scope::Module(_) => BTreeSet::new(),
                };
                let note = nodes.is_empty().then(|| {
                    "no node in its scope runs a module with settings files now".to_owned()
                });
                Reach { nodes, note }
            }
            Spec::Secret(s) => {
                let mut nodes = BTreeSet::new();
                for r in manifest {
                    if let Spec::Grant(g) = &r.spec
                        && g.secret == s.name
                    {
                        nodes.extend(self.module_nodes(&g.module, manifest).nodes);
                    }
                }
                Reach { nodes, note: None }
            }
            Spec::Grant(g) => self.module_nodes(&g.module, manifest),
        }
    }
}

/// Every item of a paged list (`?after=` cursor, `next` in the answer).
async fn pages(api: &Api, path: &str, key: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    // A bound on pages: a cursor that never ends is a bug, not a fleet.
    for _ in 0..10_000 {
        let url = match &after {
            Some(a) => format!("{path}?after={}", crate::client::urlencode(a)),
            None => path.to_owned(),
        };
        let v = api.call(Method::GET, &url, None).await?;
        if let Some(items) = v.get(key).and_then(Value::as_array) {
            out.extend(items.iter().cloned());
        }
        match v.get("next").and_then(Value::as_str) {
            Some(n) if after.as_deref() != Some(n) => after = Some(n.to_owned()),
            _ => return Ok(out),
        }
    }
    bail!("GET {path}: more pages than any fleet has")
}

fn status_of(e: &anyhow::Error) -> Option<StatusCode> {
    e.downcast_ref::<ApiError>().map(|a| a.status)
}

/// The live resource and its ETag (none: it does not exist).
async fn read_live(api: &Api, r: &Resource) -> anyhow::Result<(Option<String>, Option<Value>)> {
    match api.request(Method::GET, &r.api_path(), None, &[]).await {
        Ok(a) => {
            let etag = a.etag.with_context(|| {
                format!(
                    "GET {}: the answer has no ETag, so no write of it can be guarded",
                    r.api_path()
                )
            })?;
            Ok((Some(etag), Some(a.value)))
        }
        Err(e) if status_of(&e) == Some(StatusCode::NOT_FOUND) => Ok((None, None)),
        Err(e) => Err(e.context(format!("reading {} ({})", r.label(), r.source))),
    }
}

// ------------------------------------------------------------- planning ---

/// A plan: every resource's step, in apply order, and the manifest's digest.
pub struct Plan {
    pub steps: Vec<Step>,
    pub digest: String,
}

impl Plan {
    fn count(&self, a: Action) -> usize {
        self.steps.iter().filter(|s| s.action == a).count()
    }

    pub fn has_changes(&self) -> bool {
        self.steps.iter().any(|s| s.action != Action::Unchanged)
    }
}

/// The step of `r` given what was read of it.
pub fn step(r: Resource, etag: Option<String>, live: Option<&Value>) -> anyhow::Result<Step> {
    let (action, changes) = match live {
        None => match &r.spec {
            Spec::Secret(s) if s.value_file.is_none() => (Action::Missing, Vec::new()),
            _ => (Action::Create, Vec::new()),
        },
        Some(answer) => {
            let live = r
                .live(answer)
                .map_err(|e| anyhow::anyhow!("{} ({}): {e}", r.label(), r.source))?;
            let changes = diff(&live, &r.desired());
            if changes.is_empty() {
                (Action::Unchanged, changes)
            } else {
                (Action::Update, changes)
            }
        }
    };
    Ok(Step {
        resource: r,
        action,
        etag,
        changes,
        reach: Reach::default(),
    })
}

/// Read the live state of every resource of `resources` and the fleet; the plan.
pub async fn make_plan(api: &Api, mut resources: Vec<Resource>) -> anyhow::Result<Plan> {
    resources.sort_by_key(Resource::rank);
    let digest = manifest::digest(&resources);
    let fleet = Fleet::read(api).await?;
    let mut steps = Vec::with_capacity(resources.len());
    for r in &resources {
        let (etag, live) = read_live(api, r).await?;
        let mut s = step(r.clone(), etag, live.as_ref())?;
        if s.action != Action::Unchanged {
            s.reach = fleet.reach(r, &resources);
        }
        steps.push(s);
    }
    Ok(Plan { steps, digest })
}

/// The plan as `meshctl plan` prints it.
pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    for s in &plan.steps {
        let r = &s.resource;
        let (sign, what) = match s.action {
            Action::Create => ("+", "create".to_owned()),
            Action::Update => (
                "~",
                format!("update (ETag {})", s.etag.as_deref().unwrap_or("?")),
            ),
            Action::Unchanged => ("=", "unchanged".to_owned()),
            Action::Missing => ("!", "missing".to_owned()),
        };
        out.push_str(&format!("{sign} {}: {what}    [{}]\n", r.label(), r.source));
        for c in &s.changes {
            out.push_str(&format!(
                "    {}: {} => {}\n",
                c.field,
                short(&c.from),
                short(&c.to)
            ));
        }
        if let Spec::Secret(sec) = &r.spec {
            match s.action {
                Action::Missing => out.push_str(&format!(
                    "    the secret does not exist and the manifest gives no value_file: apply refuses until it is set (PUT /v1/secrets/{}, see \"Keep a secret\" in docs/book/src/secrets.md)\n",
                    sec.name
                )),
                Action::Create => out.push_str(
                    "    its first value is read from value_file at apply time (never printed)\n",
                ),
                _ => {}
            }
        }
        if s.action != Action::Unchanged {
            let nodes: Vec<&str> = s.reach.nodes.iter().map(String::as_str).collect();
            let list = if nodes.is_empty() {
                "no node now".to_owned()
            } else {
                nodes.join(", ")
            };
            match &s.reach.note {
                Some(n) => out.push_str(&format!("    reaches: {list} ({n})\n")),
                None => out.push_str(&format!("    reaches: {list}\n")),
            }
        }
    }
    out.push_str(&format!(
        "\nPlan: {} to create, {} to update, {} unchanged",
        plan.count(Action::Create),
        plan.count(Action::Update),
        plan.count(Action::Unchanged),
    ));
    let missing = plan.count(Action::Missing);
    if missing > 0 {
        out.push_str(&format!(", {missing} missing (apply refuses until set)"));
    }
    out.push_str(".\n");
    out
}

// ------------------------------------------------------------ plan files ---

/// What `plan --out` saves and `apply --plan` reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub format: String,
    /// The API the plan was made against.
    pub api: String,
    /// [`manifest::digest`] of the manifest planned.
    pub manifest_digest: String,
    pub resources: Vec<PlanEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanEntry {
    pub id: String,
    pub action: Action,
    /// The ETag read; null: the resource did not exist.
    pub etag: Option<String>,
}

impl PlanFile {
    pub fn of(plan: &Plan, api: &str) -> PlanFile {
        PlanFile {
            format: PLAN_FORMAT.into(),
            api: api.into(),
            manifest_digest: plan.digest.clone(),
            resources: plan
                .steps
                .iter()
                .map(|s| PlanEntry {
                    id: s.resource.id(),
                    action: s.action,
                    etag: s.etag.clone(),
                })
                .collect(),
        }
    }

    /// The steps this plan holds for `resources` (the manifest it was made
    /// from: same digest, same API), in apply order.
    pub fn steps(&self, api: &str, mut resources: Vec<Resource>) -> anyhow::Result<Vec<Step>> {
        if self.format != PLAN_FORMAT {
            bail!(
                "the plan's format is `{}`, this meshctl reads `{PLAN_FORMAT}`: plan again",
                self.format
            );
        }
        if self.api != api {
            bail!(
                "the plan was made against {}, not {api}: plan again against this API",
                self.api
            );
        }
        resources.sort_by_key(Resource::rank);
        let digest = manifest::digest(&resources);
        if digest != self.manifest_digest {
            bail!(
                "the plan was made from a different manifest (digest {}; these files give {digest}): plan them again",
                self.manifest_digest
            );
        }
        let entries: BTreeMap<&str, &PlanEntry> =
            self.resources.iter().map(|e| (e.id.as_str(), e)).collect();
        resources
            .into_iter()
            .map(|r| {
                let e = entries
                    .get(r.id().as_str())
                    .with_context(|| format!("the plan has no entry for {}: plan again", r.id()))?;
                Ok(Step {
                    action: e.action,
                    etag: e.etag.clone(),
                    changes: Vec::new(),
                    reach: Reach::default(),
                    resource: r,
                })
            })
            .collect()
    }
}

// ------------------------------------------------------------- commands ---

/// `meshctl plan`.
pub async fn plan(api: &Api, args: PlanArgs) -> anyhow::Result<ExitCode> {
    let resources = manifest::load(&args.files)?;
    let plan = make_plan(api, resources).await?;
    print!("{}", render(&plan));
    if let Some(out) = &args.out {
        let file = PlanFile::of(&plan, &api.base);
        let text = serde_json::to_string_pretty(&file)?;
        std::fs::write(out, text + "\n")
            .with_context(|| format!("writing the plan to {}", out.display()))?;
        eprintln!(
            "plan saved to {}; apply it with: meshctl apply -f <the same files> --plan {}",
            out.display(),
            out.display()
        );
    }
    Ok(if args.detailed_exitcode && plan.has_changes() {
        ExitCode::from(crate::progress::EXIT_CHANGES)
    } else {
        ExitCode::SUCCESS
    })
}

/// `meshctl apply`.
pub async fn apply(api: &Api, args: ApplyArgs) -> anyhow::Result<ExitCode> {
    if args.dry_run {
        let plan_args = PlanArgs {
            files: args.files,
            detailed_exitcode: args.detailed_exitcode,
            out: args.out,
        };
        return plan(api, plan_args).await;
    }
    let resources = manifest::load(&args.files)?;
    let steps = match &args.plan {
        None => {
            let plan = make_plan(api, resources).await?;
            print!("{}", render(&plan));
            plan.steps
        }
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the plan {}", path.display()))?;
            let file: PlanFile = serde_json::from_str(&text)
                .with_context(|| format!("{} is not a meshctl plan", path.display()))?;
            let steps = file
                .steps(&api.base, resources)
                .with_context(|| format!("plan {}", path.display()))?;
            // Everything still as the plan read it, or nothing is written.
            let mut stale = Vec::new();
            for s in &steps {
                let (etag, _) = read_live(api, &s.resource).await?;
                if etag != s.etag {
                    stale.push(format!(
                        "{} [{}]: ETag {} when planned, {} now",
                        s.resource.label(),
                        s.resource.source,
                        s.etag.as_deref().unwrap_or("(none: absent)"),
                        etag.as_deref().unwrap_or("(none: absent)"),
                    ));
                }
            }
            if !stale.is_empty() {
                for s in &stale {
                    eprintln!("meshctl: changed since the plan: {s}");
                }
                eprintln!(
                    "meshctl: 412 precondition failed: nothing was written; plan again to see the changes"
                );
                return Ok(ExitCode::from(crate::progress::EXIT_PRECONDITION));
            }
            steps
        }
    };
    // Refuse before any write: a missing secret, an unreadable value_file.
    let missing: Vec<String> = steps
        .iter()
        .filter(|s| s.action == Action::Missing)
        .map(|s| format!("{} [{}]", s.resource.label(), s.resource.source))
        .collect();
    if !missing.is_empty() {
        bail!(
            "missing: {} does not exist and its manifest gives no value_file: set it first (PUT /v1/secrets/<name>) or give value_file; nothing was written",
            missing.join(", ")
        );
    }
    let mut values: BTreeMap<String, String> = BTreeMap::new();
    for s in &steps {
        if let (Action::Create, Spec::Secret(sec)) = (s.action, &s.resource.spec)
            && let Some(p) = &sec.value_file
        {
            // Never printed: only the path names it in an error.
            let v = std::fs::read_to_string(p).with_context(|| {
                format!(
                    "{} [{}]: reading value_file {}; nothing was written",
                    s.resource.label(),
                    s.resource.source,
                    p.display()
                )
            })?;
            values.insert(s.resource.id(), v);
        }
    }
    let (mut created, mut updated) = (0, 0);
    for s in &steps {
        let r = &s.resource;
        let body = match (&r.spec, s.action) {
            (_, Action::Unchanged | Action::Missing) => continue,
            (Spec::Secret(_), _) => match values.get(&r.id()) {
                Some(v) => json!({ "value": v }),
                None => continue,
            },
            _ => r.body(),
        };
        let header = match (s.action, &s.etag) {
            (Action::Update, Some(etag)) => ("if-match", etag.as_str()),
            _ => ("if-none-match", "*"),
        };
        match api
            .request(Method::PUT, &r.api_path(), Some(&body), &[header])
            .await
        {
            Ok(a) => {
                let etag = a.etag.unwrap_or_default();
                if a.status == StatusCode::CREATED {
                    created += 1;
                    println!("+ {}: created (ETag {etag})", r.label());
                } else {
                    updated += 1;
                    println!("~ {}: updated (ETag {etag})", r.label());
                }
            }
            Err(e) if status_of(&e) == Some(StatusCode::PRECONDITION_FAILED) => {
                eprintln!(
                    "meshctl: {} [{}] changed since it was planned, not overwritten: {e}",
                    r.label(),
                    r.source
                );
                eprintln!(
                    "meshctl: {created} created and {updated} updated before it; nothing after it: plan again"
                );
                return Ok(ExitCode::from(crate::progress::EXIT_PRECONDITION));
            }
            Err(e) => {
                return Err(e.context(format!(
                    "applying {} [{}] ({created} created and {updated} updated before it; nothing after it)",
                    r.label(),
                    r.source
                )));
            }
        }
    }
    println!("Applied: {created} created, {updated} updated.");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn resources(yaml: &str) -> Vec<Resource> {
        manifest::parse(Path::new("t.yaml"), yaml).unwrap()
    }

    #[test]
    fn diff_names_changed_fields() {
        let live =
            json!({"unit": {"command": "a", "args": ["1"]}, "desired": "running", "x": null});
        let desired =
            json!({"unit": {"command": "a", "args": ["2"]}, "desired": "stopped", "y": 1});
        let d = diff(&live, &desired);
        let fields: Vec<&str> = d.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(fields, ["desired", "unit.args", "y"]);
        assert_eq!(d[1].from, json!(["1"]));
        assert_eq!(d[1].to, json!(["2"]));
        assert!(diff(&live, &live).is_empty());
    }

    #[test]
    fn steps_create_update_unchanged_missing() {
        let rs = resources(
            "kind: File\nname: motd\npath: /etc/motd\ncontent: hi\nselector: {role: web}\n---\n\
             kind: Secret\nname: pw\n---\nkind: Secret\nname: key\nvalue_file: k.txt\n",
        );
        let s = step(rs[0].clone(), None, None).unwrap();
        assert_eq!(s.action, Action::Create);
        let live = json!({"name": "motd", "path": "/etc/motd", "content": "hi", "mode": "0644",
                          "selector": {"role": "web"}, "revision": 2, "size": 2});
        let s = step(rs[0].clone(), Some("\"2\"".into()), Some(&live)).unwrap();
        assert_eq!(s.action, Action::Unchanged, "{:?}", s.changes);
        let live = json!({"name": "motd", "path": "/etc/motd", "content": "hello", "mode": "0600",
                          "node": "n1", "revision": 3});
        let s = step(rs[0].clone(), Some("\"3\"".into()), Some(&live)).unwrap();
        assert_eq!(s.action, Action::Update);
        let fields: Vec<&str> = s.changes.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(fields, ["content", "mode", "node", "selector"]);
        // A viewer's answer has no content: refused, not shown as a change.
        let viewer = json!({"name": "motd", "path": "/etc/motd", "mode": "0644", "revision": 3});
        assert!(step(rs[0].clone(), Some("\"3\"".into()), Some(&viewer)).is_err());
        assert_eq!(
            step(rs[1].clone(), None, None).unwrap().action,
            Action::Missing
        );
        assert_eq!(
            step(rs[2].clone(), None, None).unwrap().action,
            Action::Create
        );
        let secret = json!({"name": "pw", "version": 4, "versions": [], "grants": []});
        assert_eq!(
            step(rs[1].clone(), Some("\"4\"".into()), Some(&secret))
                .unwrap()
                .action,
            Action::Unchanged,
            "an existing secret's value is never compared"
        );
    }

    #[test]
    fn settings_values_are_diffed_key_by_key() {
        let rs = resources(
            "kind: Settings\nscope: labels\nname: web-eu\nselector: {role: web}\nvalues: {A: 1, B: x}\n",
        );
        let live = json!({"scope": "labels", "name": "web-eu", "selector": {"role": "web"},
                          "values": {"A": 1, "C": true}, "revision": 1});
        let s = step(rs[0].clone(), Some("\"1\"".into()), Some(&live)).unwrap();
        let fields: Vec<&str> = s.changes.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(fields, ["values.B", "values.C"]);
    }

    fn fleet() -> Fleet {
        let mut f = Fleet::default();
        for (id, role, state) in [
            ("n1", "web", "alive"),
            ("n2", "web", "alive"),
            ("n3", "db", "alive"),
            ("n4", "web", "revoked"),
        ] {
            f.nodes.insert(
                id.into(),
                (
                    BTreeMap::from([("role".to_owned(), role.to_owned())]),
                    state.into(),
                ),
            );
        }
        f.assigned
            .insert("api".into(), BTreeSet::from(["n3".to_owned()]));
        f.with_settings.insert("api".into());
        f
    }

    #[test]
    fn reach_follows_selectors_placements_and_assignments() {
        let f = fleet();
        let rs = resources(
            "kind: File\nname: motd\npath: /etc/motd\ncontent: hi\nselector: {role: web}\n---\n\
             kind: Module\nname: web\nunit: {command: x}\nplacement: {match_labels: {labels: {role: web}, replicas: 1}}\nsettings_files: [{name: a.env, format: env}]\n---\n\
             kind: Settings\nscope: global\nvalues: {}\n---\n\
             kind: Grant\nmodule: api\nsecret: pw\n---\n\
             kind: File\nname: one\npath: /etc/one\ncontent: x\nnode: n9\n",
        );
        let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        assert_eq!(
            f.reach(&rs[0], &rs).nodes,
            set(&["n1", "n2"]),
            "revoked n4 is not reached"
        );
        let m = f.reach(&rs[1], &rs);
        assert_eq!(m.nodes, set(&["n1", "n2"]));
        assert!(m.note.unwrap().contains("1 replica(s) placed among 2"));
        assert_eq!(f.reach(&rs[2], &rs).nodes, set(&["n1", "n2", "n3"]));
        assert_eq!(f.reach(&rs[3], &rs).nodes, set(&["n3"]));
        let one = f.reach(&rs[4], &rs);
        assert_eq!(one.nodes, set(&["n9"]));
        assert!(one.note.unwrap().contains("not known yet"));
    }

    #[test]
    fn a_plan_file_is_refused_for_another_manifest_or_api() {
        let rs = resources("kind: Settings\nscope: global\nvalues: {A: 1}\n");
        let plan = Plan {
            digest: manifest::digest(&rs),
            steps: vec![
                step(
                    rs[0].clone(),
                    Some("\"1\"".into()),
                    Some(&json!({"values": {"A": 2}})),
                )
                .unwrap(),
            ],
        };
        let file = PlanFile::of(&plan, "http://127.0.0.1:7700");
        let text = serde_json::to_string(&file).unwrap();
        let back: PlanFile = serde_json::from_str(&text).unwrap();
        let steps = back.steps("http://127.0.0.1:7700", rs.clone()).unwrap();
        assert_eq!(steps[0].action, Action::Update);
        assert_eq!(steps[0].etag.as_deref(), Some("\"1\""));
        assert!(back.steps("http://127.0.0.1:7701", rs).is_err());
        let other = resources("kind: Settings\nscope: global\nvalues: {A: 3}\n");
        let e = back.steps("http://127.0.0.1:7700", other).unwrap_err();
        assert!(e.to_string().contains("different manifest"), "{e}");
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        c: Cmd,
    }

    #[derive(clap::Subcommand)]
    enum Cmd {
        Apply(ApplyArgs),
        Plan(PlanArgs),
    }

    fn parse(args: &[&str]) -> Result<Cmd, clap::Error> {
        use clap::Parser as _;
        Cli::try_parse_from(std::iter::once("meshctl").chain(args.iter().copied())).map(|c| c.c)
    }

    #[test]
    fn flags() {
        let Ok(Cmd::Apply(a)) = parse(&[
            "apply",
            "-f",
            "a.yaml",
            "--filename",
            "dir",
            "--plan",
            "p.json",
        ]) else {
            panic!("apply with a plan")
        };
        assert_eq!(a.files, [PathBuf::from("a.yaml"), PathBuf::from("dir")]);
        assert_eq!(a.plan, Some(PathBuf::from("p.json")));
        assert!(!a.dry_run);
        assert!(matches!(
            parse(&[
                "apply",
                "--dry-run",
                "--detailed-exitcode",
                "--out",
                "p",
                "-f",
                "x"
            ]),
            Ok(Cmd::Apply(ApplyArgs {
                dry_run: true,
                detailed_exitcode: true,
                out: Some(_),
                ..
            }))
        ));
        assert!(
            parse(&["apply", "--detailed-exitcode", "-f", "x"]).is_err(),
            "only with --dry-run"
        );
        assert!(parse(&["apply", "--dry-run", "--plan", "p", "-f", "x"]).is_err());
        assert!(parse(&["apply"]).is_err(), "-f is required");
        assert!(matches!(
            parse(&["plan", "-f", "x", "--detailed-exitcode"]),
            Ok(Cmd::Plan(PlanArgs {
                detailed_exitcode: true,
                out: None,
                ..
            }))
        ));
        assert!(parse(&["plan"]).is_err());
    }

    #[test]
    fn long_text_prints_as_size_and_digest() {
        assert_eq!(short(&json!("hi")), "\"hi\"");
        assert!(short(&json!("a\nb")).starts_with("<3 bytes, sha256:"));
        assert_eq!(short(&Value::Null), "(none)");
    }
}
