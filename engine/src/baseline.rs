//! A benchmark's baseline: the script (PyTorch, diffusers, torchvision, AlphaFold's JAX) that
//! measures the same work as ours in a process of its own, so that each side's time and peak
//! memory are its own. Every benchmark finds the interpreter, runs the script and reads its
//! figures the same way, and a baseline that fails is named by the lines that say why.
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{ensure, Context};

/// The interpreter from `SUITE_PYTHON`, which scripts/setup.sh writes into cargo's
/// configuration (so `cargo bench` and `cargo run` set it) and gpu-check exports.
pub fn python() -> anyhow::Result<String> {
    std::env::var("SUITE_PYTHON").context(
        "SUITE_PYTHON is not set: run scripts/setup.sh and start the benchmark through cargo, or set it to a \
         Python with torch (or, where the benchmark has it, pass --no-baseline to measure ours alone)",
    )
}

/// Runs `command` (named `what` in errors) with no input and returns what it printed on
/// stdout. Its stderr is passed on as it comes (progress and warnings stay live) and kept: if
/// the process fails, the error names its exit status and [`failure_summary`] of that stderr.
pub fn run(command: &mut Command, what: &str) -> anyhow::Result<String> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what} ({:?})", command.get_program()))?;
    let mut stderr = BufReader::new(child.stderr.take().context("no stderr pipe")?);
    // stdout is read on this thread while the other passes stderr on, so that neither pipe
    // fills and stalls the child. Whole lines, through `eprint!` (which a test captures).
    let relay = std::thread::spawn(move || {
        let (mut kept, mut line) = (Vec::new(), Vec::new());
        while let Ok(1..) = stderr.read_until(b'\n', &mut line) {
            eprint!("{}", String::from_utf8_lossy(&line));
            kept.append(&mut line);
        }
        kept
    });
    let output = child.wait_with_output().with_context(|| format!("waiting for {what}"));
    let stderr = relay.join().unwrap_or_default();
    let output = output?;
    ensure!(
        output.status.success(),
        "{what} failed ({}): {}",
        output.status,
        failure_summary(&String::from_utf8_lossy(&stderr))
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The last line of `stdout` that is a JSON object: where every baseline prints its figures.
pub fn last_json(stdout: &str, what: &str) -> anyhow::Result<serde_json::Value> {
    let line = stdout
        .lines()
        .rfind(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("{what} printed no JSON line; its output was:\n{stdout}"))?;
    serde_json::from_str(line).with_context(|| format!("parsing {what}'s figures {line:?}"))
}

/// The number `key` of a baseline's figures.
pub fn number(json: &serde_json::Value, key: &str) -> anyhow::Result<f64> {
    json[key].as_f64().with_context(|| format!("no number {key:?} in {json}"))
}

/// What a failed process's stderr says went wrong: its last exception (Python's `NameError: …`,
/// or a Rust program's `Error: …`) and, where a compiler ran (torch.compile's C++ build, NVRTC),
/// the compiler's first error. torch.compile's own last lines are advice on logging, and a
/// Python traceback's last frame is code, so neither "the last line" names the cause.
pub fn failure_summary(stderr: &str) -> String {
    let lines = || stderr.lines().map(str::trim_end).filter(|l| !l.trim().is_empty());
    let is_exception = |line: &&str| {
        let Some((name, _)) = line.split_once(':') else { return false };
        let last = name.rsplit('.').next().unwrap_or(name);
        !name.starts_with(char::is_whitespace)
            && name.split('.').all(|part| !part.is_empty() && part.chars().all(|c| c.is_alphanumeric() || c == '_'))
            && ["Error", "Exception", "Failed", "Interrupt"].iter().any(|end| last.ends_with(end))
    };
    let exception = lines().rfind(is_exception);
    let compiler = lines().find(|l| l.contains("error:") && !is_exception(l));
    match (exception, compiler) {
        (Some(e), Some(c)) => format!("{e} [{}]", c.trim()),
        (Some(line), None) | (None, Some(line)) => line.trim().to_string(),
        (None, None) => lines().next_back().unwrap_or("no message").trim().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str) -> Command {
        let mut command = Command::new("sh");
        command.args(["-c", script]);
        command
    }

    #[test]
    fn a_baseline_hands_back_its_stdout_and_its_last_json_line() {
        let out =
            run(&mut shell("echo warming up >&2; echo '{\"x\": 1}'; echo '{\"x\": 2.5}'"), "the baseline").unwrap();
        let json = last_json(&out, "the baseline").unwrap();
        assert_eq!(number(&json, "x").unwrap(), 2.5);
        let missing = number(&json, "y").unwrap_err().to_string();
        assert!(missing.contains("\"y\""), "{missing}");
    }

    #[test]
    fn a_failed_baseline_is_named_by_its_status_and_its_exception() {
        // Larger than a pipe's buffer on both streams: the run must not stall on either.
        let script = "head -c 200000 /dev/zero | tr '\\0' a; echo; \
                      head -c 200000 /dev/zero | tr '\\0' b >&2; echo >&2; \
                      printf 'Traceback (most recent call last):\\n  File \"x.py\", line 3\\n    main()\\n' >&2; \
                      echo 'ModuleNotFoundError: No module named diffusers' >&2; exit 3";
        let err = run(&mut shell(script), "finetune_baseline.py").unwrap_err().to_string();
        assert!(err.starts_with("finetune_baseline.py failed (exit status: 3)"), "{err}");
        assert!(err.ends_with("ModuleNotFoundError: No module named diffusers"), "{err}");
    }

    #[test]
    fn a_baseline_without_figures_says_what_it_printed() {
        let err = last_json("loading\ndone\n", "evoformer_baseline.py").unwrap_err().to_string();
        assert!(err.contains("evoformer_baseline.py printed no JSON line") && err.contains("loading"), "{err}");
        let err = run(&mut Command::new("/nonexistent/python"), "the baseline").unwrap_err().to_string();
        assert!(err.contains("starting the baseline") && err.contains("/nonexistent/python"), "{err}");
    }

    #[test]
    fn a_failure_is_named_by_its_exception_and_its_compiler_error() {
        // The shape of the CI failure, inductor's C++ compile failing with dynamo's advice last
        // (CI's log had cut the compiler's output: this error line is made up).
        let stderr = "Traceback (most recent call last):\n  File \"vit_baseline.py\", line 205, in <module>\n    \
                      main()\ntorch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n\
                      CppCompileError: C++ compile error\n\nCommand:\ng++ /tmp/x/main.cpp -O3\n\nOutput:\n\
                      /tmp/x/main.cpp:12:5: error: '__m512' was not declared in this scope\n\
                      /tmp/x/main.cpp:13:5: error: second\n\n\
                      Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n";
        assert_eq!(
            failure_summary(stderr),
            "CppCompileError: C++ compile error [/tmp/x/main.cpp:12:5: error: '__m512' was not declared in this scope]"
        );
        let plain = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: CUDA out of memory\n";
        assert_eq!(failure_summary(plain), "RuntimeError: CUDA out of memory");
        assert_eq!(failure_summary("Error: --gpu-mem: 4Q is not a size\n"), "Error: --gpu-mem: 4Q is not a size");
        assert_eq!(failure_summary("killed\n\n"), "killed");
        assert_eq!(failure_summary(""), "no message");
    }
}
