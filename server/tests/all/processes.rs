//! The charges example as a process of a test's own: started with its arguments, its address
//! and its lines read from its stdout.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// A process of the charges example and its stdout.
pub struct Charges {
    pub child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    pub addr: String,
}

impl Charges {
    pub async fn start(args: &[String]) -> Charges {
        let mut child = Command::new(crate::walkthrough::example_binary())
            .args(args)
            .env("RUST_LOG", "off")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the charges example starts (cargo build --all-features --examples)");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next_line().await.unwrap().expect("its address");
        let addr = first
            .strip_prefix("charges on http://")
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("an unexpected first line: {first}"))
            .to_owned();
        Charges { child, lines, addr }
    }

    /// Reads stdout until a line starts with `prefix`; returns the line.
    pub async fn line(&mut self, prefix: &str) -> String {
        let reading = async {
            while let Some(line) = self.lines.next_line().await.unwrap() {
                if line.starts_with(prefix) {
                    return line;
                }
            }
            panic!("the example ended before it printed {prefix:?}");
        };
        tokio::time::timeout(Duration::from_secs(10), reading)
            .await
            .unwrap_or_else(|_| panic!("no line {prefix:?} within 10 s"))
    }
}

/// Sends `signal` (`STOP`, `CONT`) to the process.
pub fn signal(child: &Child, signal: &str) {
    let pid = child.id().expect("a running process").to_string();
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{signal}");
}
