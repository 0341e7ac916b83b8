//! The documentation's links resolve: every relative link in README.md and docs/*.md names a
//! file or folder that exists (relative to the page's folder) and, with a `#anchor`, a heading
//! of the target page whose GitHub anchor is that one (same-page `#anchor` links too). Links in
//! fenced code blocks and inline code are not links; http(s) and mailto links are not checked.
//! Each manual page opens with a contents list (within its first 20 lines, linking every `##`
//! section), and README.md stays a front page (at most 300 lines). A failure lists every broken
//! link with its file and line.
use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

/// The pages of docs/ that open with a contents list.
const MANUAL: [&str; 8] =
    ["vit.md", "fastfold.md", "diffusion.md", "engine.md", "kernels.md", "benchmarks.md", "gpu-runs.md", "testing.md"];

/// README.md's most lines.
const README_LINES: usize = 300;

/// The repository's root (this crate is `tests/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// README.md and every docs/*.md, in a fixed order.
fn pages() -> Vec<PathBuf> {
    let root = root();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("reading docs/")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// Whether `line` opens or closes a fenced code block (up to three spaces, then ``` or ~~~).
fn fence(line: &str) -> Option<&str> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    let rest = &line[indent..];
    (indent <= 3).then_some(())?;
    ["```", "~~~"].into_iter().find(|f| rest.starts_with(f))
}

/// The lines of `text` outside fenced code blocks, numbered from 1.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut open: Option<&str> = None;
    let mut lines = vec![];
    for (i, line) in text.lines().enumerate() {
        match (open, fence(line)) {
            (None, Some(f)) => open = Some(f),
            (Some(o), Some(f)) if o == f => open = None,
            (None, None) => lines.push((i + 1, line)),
            _ => {}
        }
    }
    lines
}

/// `line` without its inline code spans (a backtick run up to the next run of the same length).
fn without_code(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let run = |at: usize| chars[at..].iter().take_while(|&&c| c == '`').count();
    let (mut out, mut i) = (String::new(), 0);
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let n = run(i);
        let mut j = i + n;
        let close = loop {
            match chars[j..].iter().position(|&c| c == '`') {
                None => break None,
                Some(k) if run(j + k) == n => break Some(j + k),
                Some(k) => j += k + run(j + k),
            }
        };
        match close {
            Some(k) => {
                out.push(' ');
                i = k + n;
            }
            None => {
                out.extend(&chars[i..i + n]);
                i += n;
            }
        }
    }
    out
}

/// The targets of the inline links `[text](target)` (and images) in `line`.
fn inline_targets(line: &str) -> Vec<String> {
    let chars: Vec<char> = line.chars().collect();
    let mut targets = vec![];
    let mut i = 0;
    while i + 1 < chars.len() {
        if !(chars[i] == ']' && chars[i + 1] == '(') {
            i += 1;
            continue;
        }
        let (mut depth, mut j) = (1, i + 2);
        while j < chars.len() && depth > 0 {
            match chars[j] {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ => {}
            }
            j += 1;
        }
        if depth == 0 {
            let inner: String = chars[i + 2..j - 1].iter().collect();
            targets.push(destination(&inner));
        }
        i = j;
    }
    targets
}

/// A link's destination without its title and angle brackets.
fn destination(inner: &str) -> String {
    let inner = inner.trim();
    if let Some(rest) = inner.strip_prefix('<') {
        return rest.split('>').next().unwrap_or_default().to_string();
    }
    inner.split_whitespace().next().unwrap_or_default().to_string()
}

/// The target of a reference definition `[label]: target`.
fn reference_target(line: &str) -> Option<String> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    let rest = line[indent..].strip_prefix('[')?;
    if indent > 3 || rest.starts_with('^') {
        return None;
    }
    let (_, after) = rest.split_once("]:")?;
    Some(destination(after))
}

/// A heading's text, if `line` is an ATX heading.
fn heading(line: &str) -> Option<&str> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    let rest = &line[indent..];
    let level = rest.chars().take_while(|&c| c == '#').count();
    if indent > 3 || !(1..=6).contains(&level) {
        return None;
    }
    let text = &rest[level..];
    if !(text.is_empty() || text.starts_with(' ')) {
        return None;
    }
    Some(text.trim().trim_end_matches('#').trim_end())
}

/// GitHub's anchor for a heading: the rendered text (links reduced to their text, code and
/// emphasis marks dropped) lower-cased, every character but letters, digits, `-`, `_` and
/// spaces removed, spaces turned into `-`.
fn anchor(text: &str) -> String {
    let mut plain = String::new();
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        plain.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find("](").map(|close| (close, inline_targets(&after[close..]))) {
            Some((close, targets)) if !targets.is_empty() => {
                plain.push_str(&after[..close]);
                let skip = after[close..].find(')').map_or(after.len(), |p| close + p + 1);
                rest = &after[skip..];
            }
            _ => {
                plain.push('[');
                rest = after;
            }
        }
    }
    plain.push_str(rest);
    plain
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor of a page, duplicates numbered as GitHub numbers them (`name`, `name-1`, ...).
fn anchors(text: &str) -> Vec<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut all = vec![];
    for (_, line) in prose(text) {
        let Some(h) = heading(line) else { continue };
        let base = anchor(h);
        let n = seen.entry(base.clone()).or_insert(0);
        all.push(if *n == 0 { base.clone() } else { format!("{base}-{n}") });
        *n += 1;
    }
    all
}

/// Every link of a page outside code, with its line number.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut found = vec![];
    for (number, line) in prose(text) {
        if let Some(target) = reference_target(line) {
            found.push((number, target));
            continue;
        }
        found.extend(inline_targets(&without_code(line)).into_iter().map(|t| (number, t)));
    }
    found
}

/// Whether a link leaves the repository (checked by nobody here).
fn external(target: &str) -> bool {
    let lower = target.to_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://") || lower.starts_with("mailto:")
}

/// `%20` and the like decoded.
fn percent_decoded(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = vec![];
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'%' && i + 2 < bytes.len())
            .then(|| std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()))
            .flatten();
        match hex {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `path` with `.` and `..` resolved lexically.
fn normal(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// What is wrong with `target`, linked from `page`; `None` when it resolves.
fn broken(page: &Path, target: &str, cache: &mut BTreeMap<PathBuf, Vec<String>>) -> Option<String> {
    if target.is_empty() {
        return Some("empty link".into());
    }
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    let file = match path {
        "" => page.to_path_buf(),
        p => normal(&page.parent().expect("a page's folder").join(percent_decoded(p))),
    };
    if !file.exists() {
        return Some(format!("{} does not exist", file.display()));
    }
    let fragment = fragment?;
    if file.extension().is_none_or(|e| e != "md") {
        let line_anchor = fragment
            .strip_prefix('L')
            .is_some_and(|l| l.split("-L").all(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit())));
        return (!line_anchor).then(|| format!("#{fragment}: {} is not a markdown page", file.display()));
    }
    let known = cache.entry(file.clone()).or_insert_with(|| {
        anchors(&std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display())))
    });
    let wanted = percent_decoded(fragment);
    (!known.contains(&wanted)).then(|| format!("no heading of {} has the anchor #{wanted}", file.display()))
}

#[test]
fn every_relative_link_resolves() {
    let root = normal(&root());
    let mut cache = BTreeMap::new();
    let (mut failures, mut checked) = (vec![], 0);
    for page in pages() {
        let page = normal(&page);
        let text = std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("reading {}: {e}", page.display()));
        for (line, target) in links(&text) {
            if external(&target) {
                continue;
            }
            checked += 1;
            if let Some(why) = broken(&page, &target, &mut cache) {
                let shown = page.strip_prefix(&root).unwrap_or(&page).display().to_string();
                let why = why.replace(&format!("{}/", root.display()), "");
                failures.push(format!("{shown}:{line}: ({target}): {why}"));
            }
        }
    }
    assert!(checked > 0, "no relative links found: is the parser right?");
    assert!(failures.is_empty(), "{} broken link(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn every_manual_page_opens_with_a_contents_list() {
    let docs = root().join("docs");
    let mut failures = vec![];
    for name in MANUAL {
        let path = docs.join(name);
        let Ok(text) = std::fs::read_to_string(&path) else {
            failures.push(format!("docs/{name}: missing"));
            continue;
        };
        let local = |line: &str| -> Vec<String> {
            inline_targets(&without_code(line))
                .into_iter()
                .filter_map(|t| t.strip_prefix('#').map(String::from))
                .collect()
        };
        let lines: Vec<&str> = text.lines().collect();
        let Some(start) = lines.iter().take(20).position(|l| !local(l).is_empty()) else {
            failures.push(format!("docs/{name}: no contents list (links to its sections) in its first 20 lines"));
            continue;
        };
        // The contents list: that line and the lines after it up to the first blank one.
        let listed: Vec<String> =
            lines[start..].iter().take_while(|l| !l.trim().is_empty()).flat_map(|l| local(l)).collect();
        let sections: Vec<String> = prose(&text)
            .into_iter()
            .filter(|(_, l)| l.starts_with("## "))
            .filter_map(|(_, l)| heading(l).map(anchor))
            .collect();
        for missing in sections.iter().filter(|s| !listed.contains(s)) {
            failures.push(format!("docs/{name}: the contents list does not link section #{missing}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn readme_is_a_front_page() {
    let text = std::fs::read_to_string(root().join("README.md")).expect("reading README.md");
    let lines = text.lines().count();
    assert!(lines <= README_LINES, "README.md has {lines} lines, more than {README_LINES}: move detail to docs/");
}

#[test]
fn the_parser_reads_what_github_renders() {
    assert_eq!(anchor("`vit pretrain`: every flag"), "vit-pretrain-every-flag");
    assert_eq!(anchor("2D, 2.5D and 3D tensor parallelism"), "2d-25d-and-3d-tensor-parallelism");
    assert_eq!(anchor("The [engine](engine.md) in one page"), "the-engine-in-one-page");
    assert_eq!(anchor("ZeRO-1/2 (`DataParallel`)"), "zero-12-dataparallel");
    assert_eq!(anchors("# A\n## B\n```\n## C\n```\n## B\n"), ["a", "b", "b-1"]);
    assert_eq!(inline_targets("see [a](x.md#b) and ![i](p.png \"t\") [c](<d e.md>)"), ["x.md#b", "p.png", "d e.md"]);
    assert_eq!(inline_targets(&without_code("`[a](b)` [c](d) ``[e](f)``")), ["d"]);
    assert_eq!(reference_target("[doc]: ../docs/x.md \"title\""), Some("../docs/x.md".to_string()));
    assert_eq!(links("[a](b)\n```\n[c](d)\n```\n[e](f)"), [(1, "b".to_string()), (5, "f".to_string())]);
    assert_eq!(percent_decoded("a%20b.md"), "a b.md");
    assert!(external("https://example.com") && external("mailto:x@y") && !external("../x.md"));
}
