//! The training progress bar every binary shows.

/// The training progress bar of every binary (`show` false: a hidden one, e.g. on ranks other
/// than 0 or under `--quiet`), starting at step `done` of `total`.
pub fn progress_bar(show: bool, total: usize, done: usize) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total as u64).with_position(done as u64);
    let style =
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {elapsed_precise} < {eta_precise}  {msg}")
            .expect("a valid template");
    bar.set_style(style);
    bar
}
