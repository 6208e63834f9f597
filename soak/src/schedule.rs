//! The whole run decided up front from the seed (FoundationDB's lesson): which
//! operations the workload sends when, which faults the nemesis lands when, on
//! whom and for how long. Pure: the same seed, agents, minutes and fault kinds
//! give the same schedule (not the same interleaving: the processes are real).
//! Written to `<out>/schedule.json` before anything runs.

use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Every kind of fault the nemesis knows, in the order of `--faults`' help.
pub const FAULT_KINDS: [&str; 7] = [
    "controller-kill",
    "agent-kill",
    "agent-pause",
    "partition",
    "rabbitmq-restart",
    "postgres-restart",
    "broker-alarm",
];

/// The kinds that restart or block the machine's shared services (the
/// broker, the database): they disturb every other test of the machine.
pub const SHARED_SERVICE_KINDS: [&str; 3] =
    ["rabbitmq-restart", "postgres-restart", "broker-alarm"];

/// Files, label layers, secrets and modules the workload writes (small
/// sets: each key is written many times, so "last write wins" is tested).
pub const FILES: usize = 6;
pub const LAYERS: usize = 4;
pub const SECRETS: usize = 3;
pub const MODULES: usize = 4;
/// The roles agents are labelled with, agent `i` gets `ROLES[i % 3]`.
pub const ROLES: [&str; 3] = ["web", "db", "cache"];

/// Milliseconds into the run before the first fault (the fleet settles).
pub const FIRST_FAULT_MS: u64 = 10_000;
/// Nothing is scheduled in the last seconds: every fault heals before them.
pub const QUIET_TAIL_MS: u64 = 5_000;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Fault {
    pub id: usize,
    pub kind: String,
    /// Start, milliseconds from the run's start.
    pub at_ms: u64,
    /// How long it lasts before it is healed.
    pub for_ms: u64,
    /// Agent indices (agent faults and partitions); empty for the others.
    pub agents: Vec<usize>,
    /// `fast` / `immediate` (postgres-restart), `disk` / `memory` (broker-alarm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

impl Fault {
    pub fn end_ms(&self) -> u64 {
        self.at_ms + self.for_ms
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum OpKind {
    /// `PUT /v1/files/f<k>` for a role (or every node: `role` None).
    FilePut {
        file: usize,
        role: Option<String>,
    },
    /// `DELETE /v1/files/f<k>`.
    FileDelete {
        file: usize,
    },
    /// `PUT /v1/settings/labels/l<k>` for a role.
    SettingsPut {
        layer: usize,
        role: String,
    },
    /// `PUT /v1/secrets/s<k>` with a new value (the secret's rotation).
    SecretRotate {
        secret: usize,
    },
    /// `PUT /v1/modules/m<k>` with `replicas` on nodes of `role`.
    ModuleScale {
        module: usize,
        replicas: u32,
        role: String,
    },
    /// `POST /v1/nodes/<agent>/drain`.
    Drain {
        agent: usize,
    },
    /// `POST /v1/nodes/<agent>/undrain`.
    Undrain {
        agent: usize,
    },
    /// PUT /v1/freeze (a freeze set), DELETE /v1/freeze (lifted).
    FreezeSet,
    FreezeLift,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Op {
    pub id: usize,
    pub at_ms: u64,
    #[serde(flatten)]
    pub kind: OpKind,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Schedule {
    pub seed: u64,
    pub agents: usize,
    pub minutes: f64,
    pub kinds: Vec<String>,
    pub faults: Vec<Fault>,
    pub ops: Vec<Op>,
}

impl Schedule {
    #[cfg(test)]
    pub fn duration_ms(&self) -> u64 {
        (self.minutes * 60_000.0) as u64
    }
}

/// How long a fault of `kind` may last, in milliseconds (min, max).
fn duration_range(kind: &str) -> (u64, u64) {
    match kind {
        "controller-kill" => (2_000, 10_000),
        "agent-kill" => (3_000, 20_000),
        // Longer than the grace (3 s): the node is judged unreachable.
        "agent-pause" => (5_000, 20_000),
        "partition" => (5_000, 20_000),
        "rabbitmq-restart" => (2_000, 8_000),
        "postgres-restart" => (2_000, 6_000),
        "broker-alarm" => (5_000, 15_000),
        _ => (5_000, 10_000),
    }
}

/// Whether `kind` targets agents.
pub fn targets_agents(kind: &str) -> bool {
    matches!(kind, "agent-kill" | "agent-pause" | "partition")
}

/// Make the schedule. The first faults cover every enabled kind once, in a
/// seeded order, so even a short run sees each kind (their spacing shrinks
/// to fit when the run is short); later ones are drawn at random. Faults may
/// overlap, but never two on one agent, nor two of one shared kind.
pub fn generate(seed: u64, agents: usize, minutes: f64, kinds: &[String]) -> Schedule {
    let mut rng = StdRng::seed_from_u64(seed);
    let total = (minutes * 60_000.0) as u64;
    let last = total.saturating_sub(QUIET_TAIL_MS);

    let mut faults: Vec<Fault> = Vec::new();
    let mut first_round: Vec<String> = kinds.to_vec();
    first_round.shuffle(&mut rng);
    let mut t = FIRST_FAULT_MS;
    let mut fault_id = 0;
    while t < last {
        let uncovered = first_round.len();
        let kind = if let Some(k) = first_round.pop() {
            k
        } else if kinds.is_empty() {
            break;
        } else {
            kinds[rng.random_range(0..kinds.len())].clone()
        };
        let (lo, hi) = duration_range(&kind);
        let room = last.saturating_sub(t);
        let mut for_ms = rng.random_range(lo..=hi).min(room);
        if for_ms < 1_000 {
            break;
        }
        // Agents not under another fault for the whole window.
        let busy: BTreeSet<usize> = faults
            .iter()
            .filter(|f| f.at_ms < t + for_ms + 2_000 && f.end_ms() + 2_000 > t)
            .flat_map(|f| f.agents.iter().copied())
            .collect();
        let mut free: Vec<usize> = (0..agents).filter(|a| !busy.contains(a)).collect();
        free.shuffle(&mut rng);
        let chosen: Vec<usize> = match kind.as_str() {
            "agent-kill" | "agent-pause" => free.into_iter().take(1).collect(),
            "partition" => {
                let n = rng.random_range(1..=3usize.min(agents.max(1)));
                free.into_iter().take(n).collect()
            }
            _ => Vec::new(),
        };
        let same_kind_active = faults
            .iter()
            .any(|f| f.kind == kind && !targets_agents(&kind) && f.end_ms() + 2_000 > t);
        let skip = (targets_agents(&kind) && chosen.is_empty()) || same_kind_active;
        if !skip {
            let variant = match kind.as_str() {
                "postgres-restart" => Some(
                    if faults.iter().filter(|f| f.kind == kind).count() % 2 == 0 {
                        "fast"
                    } else {
                        "immediate"
                    }
                    .to_owned(),
                ),
                "broker-alarm" => Some(
                    if faults.iter().filter(|f| f.kind == kind).count() % 2 == 0 {
                        "disk"
                    } else {
                        "memory"
                    }
                    .to_owned(),
                ),
                _ => None,
            };
            if kind == "postgres-restart" {
                for_ms = for_ms.min(hi);
            }
            faults.push(Fault {
                id: fault_id,
                kind: kind.clone(),
                at_ms: t,
                for_ms,
                agents: chosen,
                variant,
            });
            fault_id += 1;
        } else if uncovered > 0 && faults.len() < kinds.len() {
            // Not placed now: try again at the next slot.
            first_round.insert(0, kind);
        }
        // The spacing: 10 to 30 s, less while kinds are uncovered and the
        // run would end before each had its turn.
        let mut gap = rng.random_range(10_000..=30_000u64);
        if !first_round.is_empty() {
            let fit = last.saturating_sub(t + 1_000) / (first_round.len() as u64 + 1);
            gap = gap.min(fit.max(3_000));
        }
        t += gap;
    }

    // The operations: one every 1.5 to 5 s, seeded; drains are paired with
    // their undrain (at most two nodes drained at once, every one undrained
    // before the end), the freeze with its lift.
    let mut ops = Vec::new();
    let mut t = 3_000u64;
    let mut drained: Vec<(usize, u64)> = Vec::new();
    let mut frozen_until: Option<u64> = None;
    let mut pending: Vec<(u64, OpKind)> = Vec::new();
    let op_end = last.saturating_sub(8_000);
    while t < op_end {
        let roll = rng.random_range(0..100u32);
        let role = ROLES[rng.random_range(0..ROLES.len())].to_owned();
        let kind = match roll {
            0..=29 => OpKind::FilePut {
                file: rng.random_range(0..FILES),
                role: (rng.random_range(0..4u32) != 0).then_some(role),
            },
            30..=34 => OpKind::FileDelete {
                file: rng.random_range(0..FILES),
            },
            35..=52 => OpKind::SettingsPut {
                layer: rng.random_range(0..LAYERS),
                role,
            },
            53..=64 => OpKind::SecretRotate {
                secret: rng.random_range(0..SECRETS),
            },
            65..=87 => {
                let module = rng.random_range(0..MODULES);
                // One replica per node, all or none: never more than the
                // role has nodes (an unsatisfiable placement moves nothing).
                let room = (0..agents)
                    .filter(|i| ROLES[i % ROLES.len()] == role)
                    .count()
                    .max(1) as u32;
                let replicas = rng.random_range(1..=3u32).min(room);
                OpKind::ModuleScale {
                    module,
                    replicas,
                    role,
                }
            }
            88..=95 if agents >= 3 => {
                drained.retain(|(_, until)| *until > t);
                let agent = rng.random_range(0..agents);
                if drained.len() >= 2 || drained.iter().any(|(a, _)| *a == agent) {
                    t += rng.random_range(1_500..=5_000u64);
                    continue;
                }
                let back = (t + rng.random_range(10_000..=30_000u64)).min(op_end);
                drained.push((agent, back));
                pending.push((back, OpKind::Undrain { agent }));
                OpKind::Drain { agent }
            }
            _ => {
                if frozen_until.is_some_and(|u| u > t) {
                    t += rng.random_range(1_500..=5_000u64);
                    continue;
                }
                let lift = (t + rng.random_range(5_000..=15_000u64)).min(op_end);
                frozen_until = Some(lift);
                pending.push((lift, OpKind::FreezeLift));
                OpKind::FreezeSet
            }
        };
        ops.push((t, kind));
        t += rng.random_range(1_500..=5_000u64);
    }
    ops.extend(pending);
    ops.sort_by_key(|(at, _)| *at);
    let ops = ops
        .into_iter()
        .enumerate()
        .map(|(id, (at_ms, kind))| Op { id, at_ms, kind })
        .collect();

    Schedule {
        seed,
        agents,
        minutes,
        kinds: kinds.to_vec(),
        faults,
        ops,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<String> {
        FAULT_KINDS.iter().map(|k| k.to_string()).collect()
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        assert_eq!(generate(42, 10, 3.0, &all()), generate(42, 10, 3.0, &all()));
        assert_ne!(generate(42, 10, 3.0, &all()), generate(43, 10, 3.0, &all()));
    }

    #[test]
    fn a_three_minute_run_has_every_kind_and_heals_before_the_end() {
        for seed in 0..200 {
            let s = generate(seed, 10, 3.0, &all());
            for k in FAULT_KINDS {
                assert!(
                    s.faults.iter().any(|f| f.kind == k),
                    "seed {seed}: no {k} in {:#?}",
                    s.faults
                );
            }
            for f in &s.faults {
                assert!(f.end_ms() <= s.duration_ms() - QUIET_TAIL_MS, "{f:?}");
            }
        }
    }

    #[test]
    fn no_agent_is_under_two_faults_at_once() {
        let s = generate(7, 5, 10.0, &all());
        for a in &s.faults {
            for b in &s.faults {
                if a.id < b.id && a.at_ms < b.end_ms() && b.at_ms < a.end_ms() {
                    assert!(
                        a.agents.iter().all(|x| !b.agents.contains(x)),
                        "{a:?} {b:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn no_module_asks_for_more_replicas_than_its_role_has_nodes() {
        for agents in [1, 2, 4, 5, 10] {
            let s = generate(3, agents, 10.0, &all());
            for o in &s.ops {
                if let OpKind::ModuleScale { replicas, role, .. } = &o.kind {
                    let room = (0..agents).filter(|i| ROLES[i % 3] == role).count();
                    assert!(*replicas as usize <= room.max(1), "{agents} agents: {o:?}");
                }
            }
        }
    }

    #[test]
    fn every_drain_is_undrained_and_every_freeze_lifted() {
        let s = generate(42, 10, 3.0, &all());
        let drains = s
            .ops
            .iter()
            .filter(|o| matches!(o.kind, OpKind::Drain { .. }))
            .count();
        let undrains = s
            .ops
            .iter()
            .filter(|o| matches!(o.kind, OpKind::Undrain { .. }))
            .count();
        assert_eq!(drains, undrains);
        let sets = s.ops.iter().filter(|o| o.kind == OpKind::FreezeSet).count();
        let lifts = s
            .ops
            .iter()
            .filter(|o| o.kind == OpKind::FreezeLift)
            .count();
        assert_eq!(sets, lifts);
    }
}
