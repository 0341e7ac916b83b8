//! How a command says that it failed: `Error: ` and the message, then the causes the messages
//! before them do not already say (an I/O error both named in its context's message and kept
//! as its source is said once), without libtorch's C++ stack frames, which point into
//! libtorch's sources rather than at the input at fault. With `RUST_BACKTRACE` set, the Rust
//! backtrace follows, as it does after Rust's own report.
use std::backtrace::BacktraceStatus;
use std::process::ExitCode;

/// `main`'s exit: success, or the report of [`describe`] on stderr and status 1.
pub fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("Error: {}", describe(&err));
            let backtrace = err.backtrace();
            if backtrace.status() == BacktraceStatus::Captured {
                eprintln!("\nStack backtrace:\n{backtrace}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The message a panic was raised with (`panic!` with arguments gives a `String`, without a
/// `&str`), or "a panic without a message".
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// The error and its new causes as anyhow lays them out (`Caused by:`, one numbered line
/// each), C++ stack frames left out.
pub fn describe(err: &anyhow::Error) -> String {
    let mut said: Vec<String> = Vec::new();
    for cause in err.chain() {
        let text = without_cpp_frames(&cause.to_string());
        if !text.is_empty() && !said.iter().any(|s| s.contains(&text)) {
            said.push(text);
        }
    }
    let mut out = said.first().cloned().unwrap_or_default();
    if said.len() > 1 {
        out.push_str("\n\nCaused by:");
        for (i, cause) in said[1..].iter().enumerate() {
            match said.len() {
                2 => out.push_str(&format!("\n    {cause}")),
                _ => out.push_str(&format!("\n    {i}: {cause}")),
            }
        }
    }
    out
}

/// `text` without the lines of a C++ stack trace that libtorch appends to its messages.
fn without_cpp_frames(text: &str) -> String {
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            let l = l.trim_start();
            !(l.starts_with("frame #") || l.starts_with("Exception raised from "))
        })
        .collect();
    kept.join("\n").trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_already_said_and_cpp_frames_are_left_out() {
        let io = std::io::Error::from(std::io::ErrorKind::IsADirectory);
        let err = anyhow::Error::new(std::io::Error::new(io.kind(), format!("x.png: {io}")))
            .context("writing x.png")
            .context(format!("writing x.png: {io}"));
        let text = describe(&err);
        assert_eq!(text.matches("is a directory").count(), 1, "{text}");
        assert!(!text.contains("Caused by"), "every cause was said: {text}");
        let torch = anyhow::anyhow!(
            "Internal torch error: expected m1 and m2 to have the same dtype\nException raised from \
             meta at aten/src/ATen/native/LinearAlgebra.cpp:1 (most recent call first):\nframe #0: \
             c10::Error::Error() + 0x1 (0x1 in libc10.so)\nframe #1: <unknown function> + 0x2"
        )
        .context("step 3");
        assert_eq!(
            describe(&torch),
            "step 3\n\nCaused by:\n    Internal torch error: expected m1 and m2 to have the same dtype"
        );
    }
}
