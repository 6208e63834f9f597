//! The node's packet filter: the one nftables table the connectivity section
//! declares (`inet mesh`), loaded whole with `nft -f` (one transaction: all
//! of it or nothing). The ruleset deletes and re-creates its own table, so the
//! host's other tables are left alone; the agent refuses a ruleset that
//! would flush them (`flush ruleset`).
//!
//! Applied when the declared ruleset changes, and again whenever a check finds
//! its table missing (a reboot, an operator's `nft flush ruleset`); never
//! re-loaded needlessly, so an agent restart keeps its counters and sets. A
//! generation without a firewall deletes the table the agent loaded.

use std::path::{Path, PathBuf};

use mesh_protocol::FirewallPlan;

use crate::command::{self, PrivateFile, ToolError};
use crate::config::FirewallConfig;

/// Why a ruleset was not applied: the item's error in the `applied` report.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FirewallError {
    #[error("firewall is disabled in this agent's config ([firewall] enabled = false)")]
    Disabled,
    #[error("nft not found (install nftables); the ruleset is not applied")]
    NoNft,
    #[error(
        "the ruleset flushes the whole ruleset (`flush ruleset`); it may only replace table `{0}`"
    )]
    FlushesEverything(String),
    #[error("{0}")]
    Tool(ToolError),
    #[error("{0}")]
    Io(String),
}

impl From<ToolError> for FirewallError {
    fn from(e: ToolError) -> Self {
        if e.is_not_found() {
            FirewallError::NoNft
        } else {
            FirewallError::Tool(e)
        }
    }
}

/// Loads the declared ruleset with `nft`.
#[derive(Debug, Clone)]
pub struct Firewall {
    config: FirewallConfig,
    tmp_dir: PathBuf,
}

impl Firewall {
    pub fn new(config: FirewallConfig, state_dir: &Path) -> Firewall {
        Firewall {
            config,
            tmp_dir: state_dir.join("tmp"),
        }
    }

    /// Whether the plan's table is loaded.
    pub fn loaded(&self, table: &str) -> Result<bool, FirewallError> {
        let mut args = vec!["list", "table"];
        args.extend(table.split_whitespace());
        match command::run(&self.config.nft, &args, None) {
            Ok(_) => Ok(true),
            Err(ToolError::Failed { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Load the ruleset (`nft -f`).
    pub fn apply(&self, plan: &FirewallPlan) -> Result<(), FirewallError> {
        check(plan)?;
        let file = PrivateFile::new(&self.tmp_dir, "ruleset", plan.ruleset.as_bytes())
            .map_err(|e| FirewallError::Io(format!("temporary ruleset file: {e}")))?;
        let path = file
            .path_str()
            .map_err(|e| FirewallError::Io(e.to_string()))?;
        command::run(&self.config.nft, &["-f", path], None)?;
        Ok(())
    }

    /// Delete the table (already gone is fine).
    pub fn remove(&self, table: &str) -> Result<(), FirewallError> {
        if self.loaded(table)? {
            let mut args = vec!["delete", "table"];
            args.extend(table.split_whitespace());
            command::run(&self.config.nft, &args, None)?;
        }
        Ok(())
    }
}

/// What the agent refuses before nft sees it.
fn check(plan: &FirewallPlan) -> Result<(), FirewallError> {
    let flushes = plan.ruleset.lines().any(|l| {
        let words: Vec<&str> = l
            .split('#')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        words.windows(2).any(|w| w == ["flush", "ruleset"])
    });
    if flushes {
        return Err(FirewallError::FlushesEverything(plan.table.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ruleset_that_flushes_everything_is_refused() {
        let plan = |ruleset: &str| FirewallPlan {
            table: "inet mesh".into(),
            ruleset: ruleset.into(),
        };
        assert!(check(&plan("table inet mesh {}\ndelete table inet mesh\n")).is_ok());
        assert!(check(&plan("# flush ruleset would be bad\n")).is_ok());
        let e = check(&plan("flush ruleset\ntable inet mesh {}\n")).unwrap_err();
        assert!(e.to_string().contains("inet mesh"), "{e}");
    }

    #[test]
    fn a_missing_nft_is_named() {
        let fw = Firewall::new(
            FirewallConfig {
                nft: "/nonexistent/nft".into(),
                ..FirewallConfig::default()
            },
            Path::new("/tmp"),
        );
        let e = fw.loaded("inet mesh").unwrap_err();
        assert_eq!(e, FirewallError::NoNft);
        assert!(e.to_string().contains("nft not found"));
    }
}
