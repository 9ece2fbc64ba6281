//! The README as a reader types it. Its Quickstart's commands are taken from README.md itself,
//! not from a copy, and run in a clean checkout of the repository (its tracked files, nothing
//! built or installed): the broker on the example manifests, a subscriber that sees the
//! README's output, an edit of `examples/manifests/demo.yaml` as the README words it and the
//! `UPDATED` it promises, and `top` in a real terminal. The Tests section's command is the one
//! `.ci/run` runs. A change that breaks the README fails here.
//!
//! The checkout builds into this workspace's `target/` (`CARGO_TARGET_DIR`), so a warm cache
//! keeps the release build cheap; the test sets the documented `CRD_BROKER_*` variables to put
//! the broker on free loopback ports, and nothing else.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The repository.
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// How long the first `cargo run --release` may take to build (a cold build on 2 cores takes
/// several minutes).
const BUILD: Duration = Duration::from_secs(40 * 60);

/// The section of README.md under `## {title}`, up to the next `## `.
fn section(readme: &str, title: &str) -> String {
    let heading = format!("## {title}\n");
    let start = readme
        .find(&heading)
        .unwrap_or_else(|| panic!("README.md has a section {heading:?}"));
    let body = &readme[start + heading.len()..];
    body[..body.find("\n## ").unwrap_or(body.len())].to_string()
}

/// The fenced code blocks of `text`: (info string, contents).
fn blocks(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(info)) => open = Some((info.trim().to_string(), String::new())),
            (Some(_), Some(_)) => found.extend(open.take()),
            (Some((_, body)), None) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    found
}

/// The commands of the `sh` blocks: each non-empty line that is not a comment.
fn commands(text: &str) -> Vec<String> {
    blocks(text)
        .into_iter()
        .filter(|(info, _)| info == "sh")
        .flat_map(|(_, body)| lines_of(&body))
        .collect()
}

/// The commands of one block.
fn lines_of(body: &str) -> Vec<String> {
    body.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

/// The edit the Quickstart asks for, read from its words "edit `FILE` — say, change `FROM` to
/// `TO`": the file, the text to replace and its replacement (`TO` alone is the new value of
/// `FROM`'s key).
fn edit(quickstart: &str) -> (String, String, String) {
    let words = quickstart.split_whitespace().collect::<Vec<_>>().join(" ");
    let at = words
        .find("edit `")
        .expect("the Quickstart says which file to edit");
    let after = &words[at..];
    let ticks: Vec<&str> = after.split('`').skip(1).step_by(2).take(3).collect();
    assert!(
        after.contains("change `") && ticks.len() == 3,
        "the Quickstart words an edit as: edit `FILE` — say, change `FROM` to `TO`; it says: {after}"
    );
    let (file, from, to) = (ticks[0], ticks[1], ticks[2]);
    let to = match (from.split_once(':'), to.contains(':')) {
        (Some((key, _)), false) => format!("{key}: {to}"),
        _ => to.to_string(),
    };
    (file.to_string(), from.to_string(), to)
}

/// Copies the repository's files as git knows them (tracked, and new files not ignored) into a
/// fresh `to`, keeping their modification times so that the build cache sees unchanged files
/// as unchanged. Nothing ignored comes along: no `target/`, no virtualenv, no node modules.
fn checkout(to: &Path) {
    let listed = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(ROOT)
        .output()
        .expect("git runs");
    assert!(listed.status.success(), "git ls-files");
    if to.exists() {
        std::fs::remove_dir_all(to).unwrap();
    }
    for file in listed.stdout.split(|b| *b == 0).filter(|f| !f.is_empty()) {
        let file = Path::new(std::str::from_utf8(file).unwrap());
        let from = Path::new(ROOT).join(file);
        // A file deleted but not yet staged is listed and gone: a checkout would not have it.
        let Ok(meta) = std::fs::symlink_metadata(&from) else {
            continue;
        };
        let dest = to.join(file);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        if meta.file_type().is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&from).unwrap(), &dest).unwrap();
            continue;
        }
        std::fs::copy(&from, &dest).unwrap();
        let copied = std::fs::File::options().write(true).open(&dest).unwrap();
        copied.set_modified(meta.modified().unwrap()).unwrap();
    }
    // Directories too, once their files are in (cargo compares a watched directory's time,
    // `proto/` for one), the deepest first.
    let mut dirs = vec![to.to_path_buf()];
    let mut at = 0;
    while at < dirs.len() {
        for entry in std::fs::read_dir(&dirs[at]).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() && !path.is_symlink() {
                dirs.push(path);
            }
        }
        at += 1;
    }
    for dir in dirs.iter().rev() {
        let source = Path::new(ROOT).join(dir.strip_prefix(to).unwrap());
        let modified = std::fs::metadata(&source).unwrap().modified().unwrap();
        std::fs::File::open(dir)
            .unwrap()
            .set_modified(modified)
            .unwrap();
    }
}

/// `cmd` with the environment a reader's shell would give it: this process's, without what
/// cargo sets for a test (its package, build and library-path variables, which build scripts
/// read and which would make every build differ from the reader's), with the build cache
/// shared and `env` set.
fn as_reader<'a>(cmd: &'a mut Command, env: &[(&str, String)]) -> &'a mut Command {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if (key.starts_with("CARGO") && key != "CARGO_HOME")
            || key.starts_with("RUSTC")
            || (key.starts_with("CRD_BROKER_") && key != control_plane::leash::RUN)
            || ["OUT_DIR", "LD_LIBRARY_PATH", "RUST_LOG", "RUST_BACKTRACE"].contains(&key.as_str())
        {
            cmd.env_remove(key);
        }
    }
    cmd.env("CARGO_TARGET_DIR", Path::new(ROOT).join("target"));
    cmd.envs(env.iter().map(|(k, v)| (k, v)))
}

/// `command` run by `sh` in `dir` as a reader would, by a keeper that ends it and everything it
/// starts with this test, however the test ends.
fn reader(command: &str, dir: &Path, env: &[(&str, String)]) -> Command {
    let mut cmd = control_plane::leash::tree("sh");
    cmd.arg("-c").arg(command).current_dir(dir);
    as_reader(&mut cmd, env);
    cmd
}

/// A [`reader`]'s keeper, told to end its tree when dropped (SIGTERM, then SIGKILL 5 s
/// later), and waited for.
struct Tree(Child);

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// The status code of `GET path` on `addr`, if it answers.
fn status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// The lines a child prints, as they come.
fn lines(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The next line that `matches`, within `within`.
fn line_where(
    rx: &mpsc::Receiver<String>,
    within: Duration,
    what: &str,
    matches: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if matches(&line) => return line,
            Ok(line) => seen.push(line),
            Err(_) => panic!("no {what} within {within:?}; printed: {seen:#?}"),
        }
    }
}

/// A tmux server of its own (so that its sessions have the environment it is started with),
/// killed when dropped.
struct Tmux(String);

impl Tmux {
    fn command(&self) -> Command {
        let mut cmd = Command::new("tmux");
        cmd.args(["-L", &self.0]);
        cmd
    }

    fn screen(&self) -> String {
        let out = self
            .command()
            .args(["capture-pane", "-p", "-t", "readme"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self
            .command()
            .arg("kill-server")
            .stderr(Stdio::null())
            .status();
    }
}

/// Polls `done` every 100 ms until it holds or `within` passes.
fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    done()
}

#[test]
fn the_quickstart_runs_as_written_in_a_clean_checkout() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let quickstart = section(&readme, "Quickstart");
    let commands = commands(&quickstart);
    let [serve, subscribe] = commands.as_slice() else {
        panic!("the Quickstart has two commands, the broker and a subscriber: {commands:#?}");
    };
    let shown: Vec<String> = blocks(&quickstart)
        .into_iter()
        .find(|(info, body)| info.is_empty() && body.contains("SNAPSHOT"))
        .expect("the Quickstart shows what the subscriber prints")
        .1
        .lines()
        .map(|l| l.trim_end().to_string())
        .collect();
    let top = readme
        .split('`')
        .find(|quoted| quoted.ends_with(" -- top"))
        .expect("the Quickstart names the command for top");

    // Outside target/, and gone after the test: cargo tracks the sources of what it built by
    // their paths, relative to target/ when they lie inside it. A checkout kept there left the
    // release build of the broker tied to the copy's files, which never change, so a later
    // `cargo build --release` in the repository took itself as fresh and kept the copy's
    // binary, however old. A copy deleted afterwards is missing next time: that build rebuilds.
    let checkout_dir = tempfile::Builder::new()
        .prefix("crd-broker-readme-")
        .tempdir()
        .unwrap();
    let dir = checkout_dir.path().to_path_buf();
    checkout(&dir);
    let (grpc, admin) = (control_plane::free_port(), control_plane::free_port());
    let admin_addr: SocketAddr = ([127, 0, 0, 1], admin).into();
    let env = [
        ("CRD_BROKER_GRPC_ADDR", format!("127.0.0.1:{grpc}")),
        ("CRD_BROKER_ADMIN_ADDR", admin_addr.to_string()),
        ("CRD_BROKER_SERVER", format!("http://127.0.0.1:{grpc}")),
        ("CRD_BROKER_ADMIN", format!("http://{admin_addr}")),
    ];

    // The broker, built as the README builds it.
    let started = Instant::now();
    let mut broker = Tree(
        reader(serve, &dir, &env)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    while status(admin_addr, "/readyz") != Some(200) {
        if let Ok(Some(exit)) = broker.0.try_wait() {
            panic!("`{serve}` ended ({exit}) before the broker was ready");
        }
        assert!(
            started.elapsed() < BUILD,
            "`{serve}`: not ready after {BUILD:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "`{serve}`: ready after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // The subscriber prints what the README shows.
    let mut client = Tree(
        reader(subscribe, &dir, &env)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let printed = lines(&mut client.0);
    let header = line_where(&printed, Duration::from_secs(120), "header", |_| true);
    assert_eq!(header.trim_end(), shown[0], "`{subscribe}`'s header");
    let snapshot = line_where(&printed, Duration::from_secs(30), "SNAPSHOT", |l| {
        l.starts_with("SNAPSHOT")
    });
    assert_eq!(snapshot.trim_end(), shown[1], "`{subscribe}`'s first event");

    // The edit the README describes, made to the checkout's file, is an UPDATED line.
    let (file, from, to) = edit(&quickstart);
    let path = dir.join(&file);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.matches(&from).count(), 1, "{file} holds {from} once");
    std::fs::write(&path, text.replace(&from, &to)).unwrap();
    let selector = shown[1].split_whitespace().nth(1).unwrap().to_string();
    let updated = line_where(&printed, Duration::from_secs(10), "UPDATED", |l| {
        l.starts_with("UPDATED")
    });
    assert_eq!(
        updated.split_whitespace().nth(1),
        Some(selector.as_str()),
        "{updated}"
    );

    // `top`, as the README runs it, in a 120 × 40 terminal: the watch by its short name.
    let tmux = Tmux(format!("crd-broker-readme-{}", std::process::id()));
    let mut session = tmux.command();
    session.args([
        "new-session",
        "-d",
        "-s",
        "readme",
        "-x",
        "120",
        "-y",
        "40",
        "-c",
    ]);
    // The keeper ends the session's shell, and so the session and its server, should this
    // test binary be killed before it drops them.
    let shell = format!("{top}; sleep 600");
    session
        .arg(&dir)
        .arg(control_plane::leash::tree_line(&["sh", "-c", &shell]));
    assert!(
        as_reader(&mut session, &env).status().unwrap().success(),
        "tmux starts"
    );
    let short = format!("featureflags/{}", selector.split_once('/').unwrap().1);
    assert!(
        eventually(Duration::from_secs(120), || tmux.screen().contains(&short)),
        "`{top}` shows {short}:\n{}",
        tmux.screen()
    );
}

#[test]
fn ci_runs_the_readme_test_command() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let first = blocks(&section(&readme, "Tests"))
        .into_iter()
        .find(|(info, _)| info == "sh")
        .expect("the Tests section gives the test command")
        .1;
    let tests = lines_of(&first);
    let [command] = tests.as_slice() else {
        panic!("the Tests section's first block is the one test command: {tests:#?}");
    };
    let script = Path::new(ROOT).join(command.split_whitespace().next().unwrap());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&script).unwrap().permissions());
    assert!(mode & 0o111 != 0, "{} is executable", script.display());
    let ci = std::fs::read_to_string(Path::new(ROOT).join(".ci/run")).unwrap();
    let last = ci
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap();
    assert_eq!(last, command, ".ci/run ends with the README's test command");
}

#[test]
fn the_quickstart_edit_is_read_from_its_words() {
    let words = "Now edit `examples/manifests/demo.yaml` — say, change `defaultVariant: \"off\"` to `\"on\"` — and";
    assert_eq!(
        edit(words),
        (
            "examples/manifests/demo.yaml".to_string(),
            "defaultVariant: \"off\"".to_string(),
            "defaultVariant: \"on\"".to_string()
        )
    );
}

#[test]
fn the_control_plane_commands_run_as_written() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let block = blocks(&section(&readme, "Tests"))
        .into_iter()
        .find(|(info, body)| info == "sh" && body.contains("scripts/control-plane up"))
        .expect("the Tests section shows how to start a control plane")
        .1;
    // As a reader pastes it into a shell, in a temporary directory of its own (TMPDIR), so that
    // it meets no other control plane.
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new("bash")
        .args(["-euc", &block])
        .current_dir(ROOT)
        .env("TMPDIR", tmp.path())
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("kube-system"),
        "{block}\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = tmp.path().join("crd-broker-control-plane");
    for pid in ["kube-apiserver.pid", "etcd.pid"] {
        assert!(!dir.join(pid).exists(), "down stopped {pid}");
    }
}
