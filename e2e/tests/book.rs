//! The operator's book runs (issue 31): every command example in README.md
//! and in the book's pages (docs/book/src, in SUMMARY.md's order) is run here,
//! as written, against a real mesh, so an example that rots fails CI.
//!
//! The convention (docs/book/src/introduction.md, "Examples are tests"):
//! - A fenced block whose info string is `sh`, `bash`, `shell` or `console`
//!   holds commands. Unless marked, each of its commands runs, in the page's
//!   order, in one `bash` per page, against one mesh per page (a controller
//!   and three agents, `web-1` and `web-2` labelled `role=web`, `db-1`
//!   `role=db`), and must exit 0, or the status its comment states
//!   (`# … (exit 2)`). A `console` block shows output: `$ ` starts a command,
//!   the lines below it until the next `$ ` are what it prints, each of which
//!   must be found in what it printed (whitespace collapsed, `…` standing for
//!   anything).
//! - A block that cannot run in a test (it installs packages, drives the
//!   host's systemd, raises the foundation, needs another machine…) says so
//!   just above it: `<!-- not run by the tests: <reason> -->`; one that
//!   another e2e test runs names it: `<!-- run by e2e/tests/<file>.rs::<test>
//!   -->`, and that test's source holds each of its commands.
//! - A `yaml`, `toml` or `json` block whose first line is a comment naming a
//!   relative file (`# web.yaml: …`) is written to that file in the page's
//!   working directory, so the commands below it read it.
//!
//! What the book assumes is given: `localhost:7700` (and `127.0.0.1:7700`)
//! is the test's controller, `/etc/mesh/admin-token` its admin token, the
//! node names above (and `web-3`) are the test's nodes, and
//! `/tmp/mesh-local/<node>/` is the node's directory (its `root`, `state`
//! and `agent.pid`). The working directory holds `examples/`, `db.pass`
//! (a secret's value) and `app/` (an artifact's tree: `bin/web`). `curl` fails on an HTTP error (`--fail-with-body`).
//! A command that reads (`meshctl get`, `describe`, `status`, … , `curl`
//! without a body, `cat`, `ls`) is tried again until it gives what the book
//! says or a deadline passes, since what it reads may take a moment to land;
//! a command that follows (`--follow`, `-w`, `curl -N`, `tail -f`) runs for a
//! few seconds and must still be running then.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use mesh_e2e::{Mesh, bin, wait_for};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

/// How long a reading command is tried again until it gives what the book says.
const WITHIN: Duration = Duration::from_secs(60);
/// How long any one command may take.
const COMMAND_DEADLINE: Duration = Duration::from_secs(120);
/// How long a following command runs before it is stopped.
const FOLLOW_FOR: &str = "3";

const NOT_RUN: &str = "<!-- not run by the tests:";
const RUN_BY: &str = "<!-- run by ";
const COMMAND_INFOS: [&str; 4] = ["sh", "bash", "shell", "console"];

/// The book's nodes: the agents of every page's mesh, and a name only.
const AGENTS: [(&str, &str); 3] = [("web-1", "web"), ("web-2", "web"), ("db-1", "db")];
const NAMED_NODES: [&str; 1] = ["web-3"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// README.md, then the book's pages in SUMMARY.md's order.
fn pages() -> Vec<String> {
    let summary = std::fs::read_to_string(root().join("docs/book/src/SUMMARY.md"))
        .expect("docs/book/src/SUMMARY.md");
    let mut out = vec!["README.md".to_owned()];
    for (at, _) in summary.match_indices("](") {
        let rest = &summary[at + 2..];
        if let Some(end) = rest.find(')') {
            out.push(format!("docs/book/src/{}", &rest[..end]));
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq)]
enum Mark {
    Run,
    NotRun(String),
    RunBy { file: String, test: String },
}

#[derive(Debug, Clone)]
struct Block {
    page: String,
    /// 1-based line of the opening fence.
    line: usize,
    info: String,
    /// (1-based line, text without the fence's indentation).
    lines: Vec<(usize, String)>,
    mark: Mark,
}

impl Block {
    fn is_commands(&self) -> bool {
        COMMAND_INFOS.contains(&self.info.as_str())
    }

    fn at(&self) -> String {
        format!("{}:{}", self.page, self.line)
    }
}

/// Every fenced block of `page`, with the mark just above it.
fn blocks(page: &str) -> Result<Vec<Block>, String> {
    let text = std::fs::read_to_string(root().join(page)).map_err(|e| format!("{page}: {e}"))?;
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if !trimmed.starts_with("```") {
            i += 1;
            continue;
        }
        let indent = line.len() - trimmed.len();
        let info = trimmed.trim_start_matches('`').trim().to_owned();
        let above = lines[..i]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .map(|l| l.trim())
            .unwrap_or("");
        let mark = if let Some(reason) = above.strip_prefix(NOT_RUN) {
            let reason = reason.trim().trim_end_matches("-->").trim();
            if reason.is_empty() {
                return Err(format!("{page}:{}: a not-run mark names no reason", i + 1));
            }
            Mark::NotRun(reason.to_owned())
        } else if let Some(rest) = above.strip_prefix(RUN_BY) {
            let rest = rest.trim().trim_end_matches("-->").trim();
            let (file, test) = rest.split_once("::").ok_or_else(|| {
                format!(
                    "{page}:{}: `{above}`: say `run by e2e/tests/<file>.rs::<test>`",
                    i + 1
                )
            })?;
            Mark::RunBy {
                file: file.to_owned(),
                test: test.to_owned(),
            }
        } else {
            Mark::Run
        };
        let start = i;
        let mut body = Vec::new();
        i += 1;
        while i < lines.len() && lines[i].trim() != "```" {
            let l = lines[i];
            let strip = l.len() - l.trim_start().len();
            body.push((i + 1, l[strip.min(indent)..].to_owned()));
            i += 1;
        }
        if i == lines.len() {
            return Err(format!("{page}:{}: the block is never closed", start + 1));
        }
        out.push(Block {
            page: page.to_owned(),
            line: start + 1,
            info,
            lines: body,
            mark,
        });
        i += 1;
    }
    Ok(out)
}

/// One command of a block.
#[derive(Debug, Clone)]
struct Cmd {
    line: usize,
    /// The command without its comments.
    code: String,
    comment: String,
    /// What a `console` block shows it print.
    expect: Vec<String>,
}

impl Cmd {
    /// The exit status the comment states (`(exit 2)`), else 0.
    fn status(&self) -> i32 {
        let c = &self.comment;
        c.match_indices("(exit ")
            .filter_map(|(at, _)| {
                let n: String = c[at + 6..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                n.parse().ok()
            })
            .next()
            .unwrap_or(0)
    }

    fn words(&self) -> Vec<&str> {
        self.code.split_whitespace().collect()
    }

    /// It runs until stopped: it is stopped after a few seconds.
    fn follows(&self) -> bool {
        let w = self.words();
        let curl_n = w.first() == Some(&"curl")
            && w.iter()
                .any(|a| a.starts_with('-') && !a.starts_with("--") && a.contains('N'))
            && !self.code.contains("follow=false");
        w.contains(&"--follow")
            || w.contains(&"-w")
            || w.contains(&"--watch")
            || curl_n
            || (w.first() == Some(&"tail") && w.contains(&"-f"))
    }

    /// It only reads: it is tried again until it gives what the book says.
    /// `NAME=$(…)` reads when what it runs does.
    fn reads(&self) -> bool {
        let code = self.code.as_str();
        let code = match code.split_once("=$(") {
            Some((name, rest))
                if !name.is_empty()
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                rest
            }
            _ => code,
        };
        let w: Vec<&str> = code.split_whitespace().collect();
        match w.first().copied() {
            Some("cat" | "ls" | "test") => true,
            Some("curl") => !w
                .iter()
                .any(|a| *a == "-X" || a.starts_with("-d") || a.starts_with("--data")),
            Some("meshctl") => {
                matches!(
                    w.get(1).copied(),
                    Some("get" | "describe" | "status" | "logs" | "audit" | "events")
                ) || matches!(w.get(2).copied(), Some("list" | "status" | "receipts"))
            }
            _ => false,
        }
    }
}

/// Scan shell text: (complete, the code without comments, the comments).
fn scan(text: &str) -> (bool, String, String) {
    let (mut single, mut double, mut escaped) = (false, false, false);
    let (mut code, mut comment) = (String::new(), String::new());
    let mut in_comment = false;
    let mut prev = '\n';
    for c in text.chars() {
        if in_comment {
            if c == '\n' {
                in_comment = false;
                code.push(c);
                comment.push(' ');
            } else {
                comment.push(c);
            }
            prev = c;
            continue;
        }
        if escaped {
            escaped = false;
        } else if c == '\\' && !single {
            escaped = true;
        } else if c == '\'' && !double {
            single = !single;
        } else if c == '"' && !single {
            double = !double;
        } else if c == '#' && !single && !double && prev.is_whitespace() {
            in_comment = true;
            prev = c;
            continue;
        }
        code.push(c);
        prev = c;
    }
    let continued = code.trim_end_matches([' ', '\t']).ends_with('\\');
    (!single && !double && !continued, code, comment)
}

/// The commands of a command block.
fn commands(block: &Block) -> Result<Vec<Cmd>, String> {
    let console = block.info == "console";
    let mut out: Vec<Cmd> = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (n, line) in &block.lines {
        if let Some((start, text)) = pending.as_mut() {
            text.push('\n');
            text.push_str(line);
            let (done, code, comment) = scan(text);
            if done {
                out.push(Cmd {
                    line: *start,
                    code: code.trim().to_owned(),
                    comment,
                    expect: Vec::new(),
                });
                pending = None;
            }
            continue;
        }
        let text = if console {
            match line.strip_prefix("$ ") {
                Some(cmd) => cmd,
                None => {
                    if line.trim().is_empty() {
                        continue;
                    }
                    match out.last_mut() {
                        Some(cmd) => cmd.expect.push(line.clone()),
                        None => {
                            return Err(format!(
                                "{}:{n}: output before any `$ ` command",
                                block.page
                            ));
                        }
                    }
                    continue;
                }
            }
        } else {
            if line.trim().is_empty() || line.trim_start().starts_with('#') {
                continue;
            }
            line.as_str()
        };
        let (done, code, comment) = scan(text);
        if done {
            out.push(Cmd {
                line: *n,
                code: code.trim().to_owned(),
                comment,
                expect: Vec::new(),
            });
        } else {
            pending = Some((*n, text.to_owned()));
        }
    }
    if let Some((start, _)) = pending {
        return Err(format!(
            "{}:{start}: the command never ends (an open quote or a trailing `\\`)",
            block.page
        ));
    }
    for c in &out {
        if let Some(p) = placeholder(&c.code) {
            return Err(format!(
                "{}:{}: `{}` has a placeholder, {p}: give it a value the commands above make (a variable), or mark the block not run",
                block.page, c.line, c.code
            ));
        }
        let trimmed = c.code.trim_end();
        if trimmed.ends_with('&') && !trimmed.ends_with("&&") {
            return Err(format!(
                "{}:{}: `{}` runs in the background: mark its block not run, or run it in the foreground",
                block.page, c.line, c.code
            ));
        }
    }
    Ok(out)
}

/// A `<placeholder>` outside quotes (which bash would read as redirections).
fn placeholder(code: &str) -> Option<String> {
    let (mut single, mut double) = (false, false);
    let chars: Vec<char> = code.chars().collect();
    for (i, c) in chars.iter().enumerate() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '<' if !single && !double => {
                let rest: String = chars[i + 1..]
                    .iter()
                    .take_while(|c| c.is_ascii_alphanumeric() || **c == '-' || **c == '_')
                    .collect();
                if !rest.is_empty() && chars.get(i + 1 + rest.len()) == Some(&'>') {
                    return Some(format!("<{rest}>"));
                }
            }
            _ => {}
        }
    }
    None
}

/// The file a `yaml`/`toml`/`json` block is, when its first line names a
/// relative one (`# web.yaml: …`).
fn file_block(block: &Block) -> Option<String> {
    if !["yaml", "yml", "toml", "json"].contains(&block.info.as_str()) {
        return None;
    }
    let first = block.lines.first()?.1.trim();
    let name = first
        .strip_prefix('#')?
        .split_whitespace()
        .next()?
        .trim_end_matches(':');
    let ok = !name.starts_with(['/', '~', '.'])
        && [".yaml", ".yml", ".toml", ".json"]
            .iter()
            .any(|x| name.ends_with(x))
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
    ok.then(|| name.to_owned())
}

/// `needle` in `hay`, with whitespace collapsed and `…` standing for
/// anything within one line.
fn shows(hay: &str, needle: &str) -> bool {
    let collapse = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let parts: Vec<String> = needle
        .split('…')
        .map(collapse)
        .filter(|p| !p.is_empty())
        .collect();
    if parts.is_empty() {
        return true;
    }
    hay.lines().map(collapse).any(|line| {
        let mut from = 0;
        parts.iter().all(|p| match line[from..].find(p.as_str()) {
            Some(at) => {
                from += at + p.len();
                true
            }
            None => false,
        })
    })
}

/// Replace whole words (node names) once, left to right.
fn replace_words(text: &str, words: &[(String, String)]) -> String {
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    'outer: while i < text.len() {
        let before_ok = text[..i].chars().next_back().is_none_or(|c| !name_char(c));
        if before_ok {
            for (from, to) in words {
                if text[i..].starts_with(from.as_str())
                    && text[i + from.len()..]
                        .chars()
                        .next()
                        .is_none_or(|c| !name_char(c))
                {
                    out.push_str(to);
                    i += from.len();
                    continue 'outer;
                }
            }
        }
        let c = text[i..].chars().next().unwrap_or(' ');
        out.push(c);
        i += c.len_utf8();
    }
    out
}

/// Where the book's words meet the test's mesh.
struct Places {
    api_host_port: String,
    work: PathBuf,
    /// (book's node name, the test's node id).
    nodes: Vec<(String, String)>,
    /// (book's node name, its directory in the test).
    dirs: Vec<(String, PathBuf)>,
}

impl Places {
    fn apply(&self, text: &str) -> String {
        let mut t = text
            .replace("localhost:7700", &self.api_host_port)
            .replace("127.0.0.1:7700", &self.api_host_port)
            .replace(
                "/etc/mesh/admin-token",
                &self.work.join("admin-token").display().to_string(),
            );
        for (name, dir) in &self.dirs {
            t = t.replace(
                &format!("/tmp/mesh-local/{name}/"),
                &format!("{}/", dir.display()),
            );
        }
        replace_words(&t, &self.nodes)
    }
}

/// One `bash` for a page's commands: what one command sets (a variable, an
/// export) the next sees.
struct Shell {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    out: PathBuf,
}

impl Shell {
    fn start(work: &Path, bin_dir: &Path, home: &Path) -> anyhow::Result<Shell> {
        let mut child = tokio::process::Command::new("bash")
            .args(["--noprofile", "--norc"])
            .current_dir(work)
            .env_clear()
            .env(
                "PATH",
                format!(
                    "{}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                    bin_dir.display()
                ),
            )
            .env("HOME", home)
            .env("LANG", "C.UTF-8")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdin"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        Ok(Shell {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            out: work.join(".book-output"),
        })
    }

    /// Run `code`: (exit status, stdout and stderr).
    async fn run(&mut self, code: &str) -> anyhow::Result<(i32, String)> {
        // Through `eval`, so that a command bash cannot parse is a failed
        // command (status 2), not the end of the page's shell.
        let script = format!(
            "eval '{code}' >{out} 2>&1 </dev/null; echo \"@@book-rc $?\"\n",
            code = code.replace('\'', "'\\''"),
            out = self.out.display()
        );
        self.stdin.write_all(script.as_bytes()).await?;
        self.stdin.flush().await?;
        let status = tokio::time::timeout(COMMAND_DEADLINE, async {
            while let Some(line) = self.lines.next_line().await? {
                if let Some(rc) = line.strip_prefix("@@book-rc ") {
                    return Ok::<_, anyhow::Error>(rc.trim().parse::<i32>()?);
                }
            }
            anyhow::bail!("bash ended")
        })
        .await
        .map_err(|_| anyhow::anyhow!("still running after {COMMAND_DEADLINE:?}"))??;
        let output = std::fs::read_to_string(&self.out).unwrap_or_default();
        Ok((status, output))
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// The files and tools a page's commands find: `examples/`, `db.pass`, `app/`, the
/// admin token, `meshctl` on the PATH, a `curl` that fails on an HTTP error.
fn workdir(mesh: &Mesh, work: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    use std::os::unix::fs::PermissionsExt as _;
    std::os::unix::fs::symlink(root().join("examples"), work.join("examples"))?;
    std::fs::write(
        work.join("admin-token"),
        format!("{}\n", mesh.admin_token()),
    )?;
    std::fs::write(work.join("db.pass"), "correct horse battery staple")?;
    // What Delivery pushes as an artifact: a tree with its `bin/web`.
    let web = work.join("app/bin/web");
    std::fs::create_dir_all(web.parent().unwrap_or(work))?;
    std::fs::write(
        &web,
        "#!/bin/sh\n# a stand-in for a service: runs until stopped\nexec sleep infinity\n",
    )?;
    std::fs::set_permissions(&web, std::fs::Permissions::from_mode(0o755))?;
    let home = work.join("home");
    std::fs::create_dir_all(&home)?;
    let bin_dir = work.join("bin");
    std::fs::create_dir_all(&bin_dir)?;
    std::os::unix::fs::symlink(bin("meshctl")?, bin_dir.join("meshctl"))?;
    let curl = bin_dir.join("curl");
    std::fs::write(
        &curl,
        "#!/bin/sh\nexec /usr/bin/curl --fail-with-body \"$@\"\n",
    )?;
    std::fs::set_permissions(&curl, std::fs::Permissions::from_mode(0o755))?;
    Ok((bin_dir, home))
}

/// Check a run-by mark: the named test exists and holds each command.
fn check_run_by(block: &Block, file: &str, test: &str) -> Result<(), String> {
    let src = std::fs::read_to_string(root().join(file))
        .map_err(|e| format!("{}: names {file}: {e}", block.at()))?;
    let Some(at) = src.find(&format!("fn {test}(")) else {
        return Err(format!("{}: {file} has no test `{test}`", block.at()));
    };
    let body_end = src[at..].find("\n}\n").map_or(src.len(), |e| at + e);
    let body = &src[at..body_end];
    for cmd in commands(block)? {
        let words = cmd.words();
        // A test runs `meshctl` as `meshctl_command().args([…])`: its
        // arguments, quoted, are the command.
        let quoted = words
            .iter()
            .skip(usize::from(words.first() == Some(&"meshctl")))
            .map(|w| format!("{:?}", w.trim_matches(['"', '\''])))
            .collect::<Vec<_>>()
            .join(", ");
        let plain = words.join(" ");
        if !body.contains(&plain) && !body.contains(&quoted) {
            return Err(format!(
                "{}:{}: `{plain}`: {file}::{test} does not run it (neither the line nor [{quoted}] is in it)",
                block.page, cmd.line
            ));
        }
    }
    Ok(())
}

/// Every command block is run here, marked not run with a reason, or names
/// a test that runs it; nothing that looks like a command hides in a block
/// with another info string.
#[test]
fn every_command_block_is_run_or_marked() {
    let mut problems = Vec::new();
    let (mut run, mut not_run, mut run_by, mut cmds) = (0, 0, 0, 0);
    for page in pages() {
        let blocks = match blocks(&page) {
            Ok(b) => b,
            Err(e) => {
                problems.push(e);
                continue;
            }
        };
        for b in &blocks {
            if !b.is_commands() {
                if b.mark != Mark::Run {
                    problems.push(format!(
                        "{}: a `{}` block is marked, but only command blocks are run",
                        b.at(),
                        b.info
                    ));
                }
                if let Some((n, l)) = b.lines.iter().find(|(_, l)| {
                    let l = l.trim_start();
                    l.starts_with("meshctl ") || l.starts_with("curl ") || l.starts_with("$ ")
                }) {
                    problems.push(format!(
                        "{}:{n}: `{l}` is a command in a block fenced `{}`: fence it `sh` (or `console`)",
                        b.page,
                        if b.info.is_empty() { "```" } else { &b.info }
                    ));
                }
                continue;
            }
            match &b.mark {
                Mark::Run => match commands(b) {
                    Ok(c) if c.is_empty() => problems.push(format!("{}: no command", b.at())),
                    Ok(c) => {
                        run += 1;
                        cmds += c.len();
                    }
                    Err(e) => problems.push(e),
                },
                Mark::NotRun(_) => not_run += 1,
                Mark::RunBy { file, test } => {
                    run_by += 1;
                    if let Err(e) = check_run_by(b, file, test) {
                        problems.push(e);
                    }
                }
            }
        }
    }
    eprintln!(
        "command blocks: {run} run here ({cmds} commands), {run_by} run by another test, {not_run} marked not run"
    );
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(run >= 10, "only {run} blocks run: the scan is not vacuous");
}

/// Run one page's command blocks against a fresh mesh; every failure, named
/// by file and line.
async fn run_page(page: &str) -> anyhow::Result<()> {
    let blocks = blocks(page).map_err(anyhow::Error::msg)?;
    let runnable: Vec<&Block> = blocks
        .iter()
        .filter(|b| b.is_commands() && b.mark == Mark::Run)
        .collect();
    let not_run = blocks
        .iter()
        .filter(|b| b.is_commands() && b.mark != Mark::Run)
        .count();
    if runnable.is_empty() {
        eprintln!("{page}: no command block to run ({not_run} marked)");
        return Ok(());
    }
    let mut mesh = Mesh::start().await?;
    let mut nodes = Vec::new();
    let mut dirs = Vec::new();
    for (name, role) in AGENTS {
        let id = mesh.add_agent(name, &[("role", role)]).await?;
        let agent = mesh.agent(&id);
        let dir = agent
            .root
            .parent()
            .ok_or_else(|| anyhow::anyhow!("agent root has no parent"))?
            .to_owned();
        if let Some(pid) = agent.pid() {
            std::fs::write(dir.join("agent.pid"), format!("{pid}\n"))?;
        }
        nodes.push((name.to_owned(), id));
        dirs.push((name.to_owned(), dir));
    }
    for name in NAMED_NODES {
        nodes.push((name.to_owned(), format!("{}-{name}", mesh.env.id())));
    }
    let ids: Vec<String> = nodes
        .iter()
        .take(AGENTS.len())
        .map(|n| n.1.clone())
        .collect();
    wait_for("the book's nodes to be alive", WITHIN, || async {
        for id in &ids {
            let (_, v) = mesh.get(&format!("/v1/nodes/{id}")).await?;
            if v["state"] != "alive" {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await?;

    let work = tempfile::tempdir()?;
    let (bin_dir, home) = workdir(&mesh, work.path())?;
    let places = Places {
        api_host_port: mesh.api.trim_start_matches("http://").to_owned(),
        work: work.path().to_owned(),
        nodes,
        dirs,
    };
    for b in &blocks {
        if let Some(name) = file_block(b) {
            let text: Vec<String> = b.lines.iter().map(|(_, l)| places.apply(l)).collect();
            let path = work.path().join(&name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(path, text.join("\n") + "\n")?;
        }
    }
    let mut shell = Shell::start(work.path(), &bin_dir, &home)?;
    // What the book's introduction says is set (A first mesh, "Authenticate").
    let (rc, out) = shell
        .run(&places.apply(
            "export AUTH=\"Authorization: Bearer $(cat /etc/mesh/admin-token)\" \
             MESH_API=http://127.0.0.1:7700 MESH_TOKEN_FILE=/etc/mesh/admin-token",
        ))
        .await?;
    anyhow::ensure!(rc == 0, "the prelude: {out}");

    let mut failures = Vec::new();
    let mut ran = 0;
    for b in runnable {
        let cmds = commands(b).map_err(anyhow::Error::msg)?;
        for cmd in cmds {
            ran += 1;
            let code = places.apply(&cmd.code);
            let expect: Vec<String> = cmd.expect.iter().map(|e| places.apply(e)).collect();
            let (code, want) = if cmd.follows() {
                (format!("timeout {FOLLOW_FOR} {code}"), 124)
            } else {
                (code, cmd.status())
            };
            let started = Instant::now();
            let mut last;
            loop {
                let (rc, out) = shell.run(&code).await?;
                let missing: Vec<&String> = expect.iter().filter(|e| !shows(&out, e)).collect();
                last = (
                    rc,
                    out.clone(),
                    missing.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                );
                if rc == want && missing.is_empty() {
                    break;
                }
                if !cmd.reads() || started.elapsed() > WITHIN {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            let (rc, out, missing) = last;
            if rc != want || !missing.is_empty() {
                failures.push(format!(
                    "{page}:{}: `{}`\n  exit {rc} (the book: {want}){}\n  output:\n{}",
                    cmd.line,
                    cmd.code,
                    if missing.is_empty() {
                        String::new()
                    } else {
                        format!("\n  the book shows, not printed: {missing:?}")
                    },
                    out.lines()
                        .take(40)
                        .map(|l| format!("    {l}"))
                        .collect::<Vec<_>>()
                        .join("\n")
                ));
            } else {
                eprintln!(
                    "{page}:{}: ok ({:?}) `{}`",
                    cmd.line,
                    started.elapsed(),
                    cmd.code
                );
            }
        }
    }
    drop(shell);
    eprintln!(
        "{page}: {ran} commands run, {} failed; {not_run} blocks marked",
        failures.len()
    );
    // A failed page drops its mesh untorn, so the harness prints the
    // processes' logs.
    anyhow::ensure!(failures.is_empty(), "{}", failures.join("\n\n"));
    mesh.teardown().await
}

/// The reading of blocks: continued lines and quotes, comments, the exit
/// status a comment states, placeholders, output with `…`.
#[test]
fn commands_are_read_as_bash_would() {
    let block = |info: &str, text: &str| Block {
        page: "p.md".into(),
        line: 1,
        info: info.into(),
        lines: text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 2, l.to_owned()))
            .collect(),
        mark: Mark::Run,
    };
    let b = block(
        "sh",
        "# a comment\ncurl -s -X PUT x \\\n  -d '{\n  \"a\": 1}'   # made # here\nls nothing   # gone (exit 2)\n",
    );
    let c = commands(&b).expect("commands");
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!(c[0].line, 3);
    assert!(c[0].code.ends_with("\"a\": 1}'"), "{:?}", c[0].code);
    assert!(!c[0].reads() && c[1].reads());
    assert_eq!((c[0].status(), c[1].status()), (0, 2));
    let c = commands(&block(
        "console",
        "$ meshctl get nodes -w\nNAME  STATE\n…  alive",
    ))
    .expect("console");
    assert_eq!(c[0].expect, ["NAME  STATE", "…  alive"]);
    assert!(c[0].follows());
    assert!(commands(&block("sh", "meshctl token revoke <id>")).is_err());
    assert!(commands(&block("sh", "meshctl get nodes -w &")).is_err());
    assert!(commands(&block("sh", "echo '<id>'")).is_ok());
    assert!(shows(
        "x\nweb-1   alive   3s  role=web\n",
        "web-1 alive … role=web"
    ));
    assert!(!shows("web-1 unreachable", "web-1 alive"));
    assert_eq!(
        replace_words(
            "web-1 mesh-web-1 /x/web-1/ web-10",
            &[("web-1".into(), "t-web-1".into())]
        ),
        "t-web-1 mesh-web-1 /x/t-web-1/ web-10"
    );
}

/// Every page of SUMMARY.md and README.md has its test below.
#[test]
fn every_page_has_its_test() {
    let src = std::fs::read_to_string(root().join("e2e/tests/book.rs")).expect("book.rs");
    for page in pages() {
        assert!(
            src.contains(&format!("run_page({page:?})")),
            "{page} has no test in e2e/tests/book.rs: add one that calls run_page({page:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn readme() -> anyhow::Result<()> {
    run_page("README.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn introduction() -> anyhow::Result<()> {
    run_page("docs/book/src/introduction.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn install() -> anyhow::Result<()> {
    run_page("docs/book/src/install.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn first_mesh() -> anyhow::Result<()> {
    run_page("docs/book/src/first-mesh.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn files_and_settings() -> anyhow::Result<()> {
    run_page("docs/book/src/files-and-settings.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn secrets() -> anyhow::Result<()> {
    run_page("docs/book/src/secrets.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn modules_and_placement() -> anyhow::Result<()> {
    run_page("docs/book/src/modules-and-placement.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn delivery() -> anyhow::Result<()> {
    run_page("docs/book/src/delivery.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn grants() -> anyhow::Result<()> {
    run_page("docs/book/src/grants.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn observability() -> anyhow::Result<()> {
    run_page("docs/book/src/observability.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn backup_and_restore() -> anyhow::Result<()> {
    run_page("docs/book/src/backup-and-restore.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn scaling() -> anyhow::Result<()> {
    run_page("docs/book/src/scaling.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn upgrades() -> anyhow::Result<()> {
    run_page("docs/book/src/upgrades.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn security() -> anyhow::Result<()> {
    run_page("docs/book/src/security.md").await
}

#[tokio::test(flavor = "multi_thread")]
async fn troubleshooting() -> anyhow::Result<()> {
    run_page("docs/book/src/troubleshooting.md").await
}
