//! Where `meshctl` finds the API, the token and the CA: a flag, then the
//! environment (`MESH_API`, `MESH_TOKEN`, `MESH_TOKEN_FILE`, `MESH_CA`), then
//! a config file (`--config` / `MESH_CONFIG`, else
//! `~/.config/mesh/meshctl.toml` when it exists), then the default.
//!
//! The file holds `api`, `token_file` and `ca` (never a token itself); a
//! relative path in it is relative to the file. An unknown key, a file that
//! does not parse, or a named file that cannot be read is an error naming it.
//! The token is a [`Token`], which never prints.

use anyhow::{Context as _, bail};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The API when nothing names one.
pub const DEFAULT_API: &str = "http://127.0.0.1:7700";
/// The mesh CA when nothing names one (bundle/up writes it).
pub const DEFAULT_CA: &str = "/etc/mesh/ca.pem";

/// Where a value came from, strongest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    Default,
    File,
    Env,
    Flag,
}

impl Source {
    /// Where a setting came from, for an error about it.
    pub fn describe(self, flag: &str, env: &str) -> String {
        match self {
            Source::Flag => flag.to_owned(),
            Source::Env => env.to_owned(),
            Source::File => "the config file".to_owned(),
            Source::Default => "the default".to_owned(),
        }
    }
}

/// A value and where it came from.
pub type Given<T> = Option<(T, Source)>;

/// The config file's keys.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// The controller's API URL.
    pub api: Option<String>,
    /// A file holding the API token (its first line).
    pub token_file: Option<PathBuf>,
    /// The mesh CA's certificate (PEM).
    pub ca: Option<PathBuf>,
}

/// What the command line and the environment gave (clap tells which).
#[derive(Debug, Default)]
pub struct Inputs {
    pub api: Given<String>,
    pub token: Given<String>,
    pub token_file: Given<PathBuf>,
    pub ca: Given<PathBuf>,
}

/// An API token: Debug and Display print `[redacted]`.
#[derive(Clone, PartialEq)]
pub struct Token(String);

impl Token {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

/// Where the token comes from, once precedence has chosen.
#[derive(Debug, PartialEq)]
pub enum TokenFrom {
    None,
    Inline(Token),
    File(PathBuf, Source),
}

/// The settings a command runs with.
#[derive(Debug, PartialEq)]
pub struct Resolved {
    pub api: String,
    pub api_from: Source,
    pub token: TokenFrom,
    pub ca: PathBuf,
    pub ca_from: Source,
}

/// Precedence, pure: flag > env > file > default, for each setting; a token
/// and a token file given at the same level: the token.
pub fn resolve(inputs: Inputs, file: Option<(&Path, FileConfig)>) -> Resolved {
    let (dir, file) = match file {
        Some((path, f)) => (path.parent().map(Path::to_path_buf), f),
        None => (None, FileConfig::default()),
    };
    // A relative path in the file is relative to the file.
    let near = |p: PathBuf| match &dir {
        Some(d) if p.is_relative() => d.join(p),
        _ => p,
    };
    let pick = |given: Option<(String, Source)>, from_file: Option<String>, default: &str| {
        given
            .or(from_file.map(|v| (v, Source::File)))
            .unwrap_or((default.to_owned(), Source::Default))
    };
    let (api, api_from) = pick(inputs.api, file.api, DEFAULT_API);
    let (ca, ca_from) = inputs
        .ca
        .or(file.ca.map(|c| (near(c), Source::File)))
        .unwrap_or((PathBuf::from(DEFAULT_CA), Source::Default));
    let token_file = inputs
        .token_file
        .or(file.token_file.map(|t| (near(t), Source::File)));
    let token = match (inputs.token, token_file) {
        (Some((t, ts)), Some((_, fs))) if ts >= fs => TokenFrom::Inline(Token(t)),
        (Some(_), Some((f, fs))) => TokenFrom::File(f, fs),
        (Some((t, _)), None) => TokenFrom::Inline(Token(t)),
        (None, Some((f, fs))) => TokenFrom::File(f, fs),
        (None, None) => TokenFrom::None,
    };
    Resolved {
        api,
        api_from,
        token,
        ca,
        ca_from,
    }
}

/// Reads and parses a config file; errors name the file (and the key).
pub fn read_file(path: &Path) -> anyhow::Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    parse_file(path, &text)
}

pub fn parse_file(path: &Path, text: &str) -> anyhow::Result<FileConfig> {
    toml::from_str(text).map_err(|e| {
        anyhow::anyhow!(
            "config file {}: {} (keys: api, token_file, ca)",
            path.display(),
            e.message()
        )
    })
}

/// The config file to read: the one named (it must be readable), else the
/// default one when it exists.
pub fn file_path(named: Option<PathBuf>) -> Option<PathBuf> {
    if named.is_some() {
        return named;
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    let path = base.join("mesh").join("meshctl.toml");
    path.exists().then_some(path)
}

/// The token a [`TokenFrom`] names: a file's first line, trimmed.
pub fn load_token(from: TokenFrom) -> anyhow::Result<Option<Token>> {
    match from {
        TokenFrom::None => Ok(None),
        TokenFrom::Inline(t) if t.0.trim().is_empty() => {
            bail!("the token (--token / MESH_TOKEN) is empty")
        }
        TokenFrom::Inline(t) => Ok(Some(t)),
        TokenFrom::File(path, source) => {
            let how = match source {
                Source::Flag => "--token-file",
                Source::Env => "MESH_TOKEN_FILE",
                _ => "the config file's token_file",
            };
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading the token file {} ({how})", path.display()))?;
            let token = text.lines().next().unwrap_or("").trim();
            if token.is_empty() {
                bail!("the token file {} ({how}) is empty", path.display());
            }
            Ok(Some(Token(token.to_owned())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag<T>(v: T) -> Given<T> {
        Some((v, Source::Flag))
    }
    fn env<T>(v: T) -> Given<T> {
        Some((v, Source::Env))
    }

    fn file(text: &str) -> FileConfig {
        parse_file(Path::new("/etc/x/meshctl.toml"), text).unwrap()
    }

    #[test]
    fn defaults_when_nothing_is_given() {
        let r = resolve(Inputs::default(), None);
        assert_eq!(r.api, DEFAULT_API);
        assert_eq!(r.api_from, Source::Default);
        assert_eq!(r.ca, PathBuf::from(DEFAULT_CA));
        assert_eq!(r.token, TokenFrom::None);
    }

    #[test]
    fn flag_beats_env_beats_file_beats_default() {
        let cfg =
            || file("api = \"https://file:7443\"\ntoken_file = \"token\"\nca = \"/abs/ca.pem\"\n");
        let path = Path::new("/etc/x/meshctl.toml");
        let r = resolve(Inputs::default(), Some((path, cfg())));
        assert_eq!(
            (r.api.as_str(), r.api_from),
            ("https://file:7443", Source::File)
        );
        assert_eq!(r.ca, PathBuf::from("/abs/ca.pem"));
        assert_eq!(
            r.token,
            TokenFrom::File(PathBuf::from("/etc/x/token"), Source::File),
            "relative to the file"
        );

        let r = resolve(
            Inputs {
                api: env("https://env:7443".into()),
                ca: env("/env/ca.pem".into()),
                token: env("t-env".into()),
                ..Inputs::default()
            },
            Some((path, cfg())),
        );
        assert_eq!(
            (r.api.as_str(), r.api_from),
            ("https://env:7443", Source::Env)
        );
        assert_eq!(r.ca, PathBuf::from("/env/ca.pem"));
        assert_eq!(r.token, TokenFrom::Inline(Token("t-env".into())));

        let r = resolve(
            Inputs {
                api: flag("https://flag:7443".into()),
                token_file: flag("/flag/token".into()),
                token: env("t-env".into()),
                ..Inputs::default()
            },
            Some((path, cfg())),
        );
        assert_eq!(
            (r.api.as_str(), r.api_from),
            ("https://flag:7443", Source::Flag)
        );
        assert_eq!(
            r.token,
            TokenFrom::File("/flag/token".into(), Source::Flag),
            "a --token-file flag beats MESH_TOKEN"
        );
        let r = resolve(
            Inputs {
                token: flag("t".into()),
                token_file: flag("/f".into()),
                ..Inputs::default()
            },
            None,
        );
        assert_eq!(
            r.token,
            TokenFrom::Inline(Token("t".into())),
            "a tie: --token"
        );
    }

    #[test]
    fn a_bad_file_is_an_error_naming_it_and_the_key() {
        let e = parse_file(
            Path::new("/etc/x/meshctl.toml"),
            "api = \"x\"\ntokn = \"t\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("/etc/x/meshctl.toml") && e.contains("tokn"),
            "{e}"
        );
        let e = parse_file(Path::new("/c.toml"), "api = 5")
            .unwrap_err()
            .to_string();
        assert!(e.contains("/c.toml"), "{e}");
        let e = read_file(Path::new("/nonexistent/meshctl.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/meshctl.toml"), "{e}");
    }

    #[test]
    fn tokens_never_print_and_files_are_read_trimmed() {
        let t = Token("s3cret".into());
        assert_eq!(format!("{t} {t:?}"), "[redacted] [redacted]");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("token");
        std::fs::write(&f, "s3cret\n").unwrap();
        let got = load_token(TokenFrom::File(f.clone(), Source::Env))
            .unwrap()
            .unwrap();
        assert_eq!(got.expose(), "s3cret");
        std::fs::write(&f, "\n").unwrap();
        let e = load_token(TokenFrom::File(f.clone(), Source::Env))
            .unwrap_err()
            .to_string();
        assert!(e.contains("MESH_TOKEN_FILE") && e.contains("empty"), "{e}");
        assert!(
            !format!(
                "{:?}",
                resolve(
                    Inputs {
                        token: flag("s3cret".into()),
                        ..Inputs::default()
                    },
                    None
                )
            )
            .contains("s3cret")
        );
    }
}
