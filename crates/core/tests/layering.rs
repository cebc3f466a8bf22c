//! The module graph has no arrow up, and so no circle: every module of `src/` uses only
//! the modules listed before it in the list "Modules, lowest first" of the crate
//! documentation (the top of `src/lib.rs`), and that list names every module once.
//!
//! A scan of the source text, not of the compiler's view: comments (doc comments
//! included: their links may point anywhere), string and character literals are skipped;
//! what counts is every path that starts at the crate root — `crate::m`, `$crate::m`,
//! `crate::{m, ...}`, or a chain of `super::` that climbs out of the top module (inline
//! `mod name { ... }` blocks are followed, so a test module's `use super::*` stays
//! inside). A root name that is not a module (`crate::Error`) counts as the module that
//! `src/lib.rs` re-exports it from.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The heading in `src/lib.rs` that the ordered list follows.
const HEADING: &str = "Modules, lowest first";

#[test]
fn every_module_uses_only_modules_listed_before_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let order = listed_modules(&lib);
    assert!(
        !order.is_empty(),
        "src/lib.rs has no list under a heading '# {HEADING}'"
    );

    // The list and the modules on disk: the same names, each once.
    let on_disk = modules_on_disk(&src);
    let mut problems = Vec::new();
    for (i, m) in order.iter().enumerate() {
        if order[..i].contains(m) {
            problems.push(format!("src/lib.rs: `{m}` is listed twice"));
        }
        if !on_disk.contains(m) {
            problems.push(format!(
                "src/lib.rs: `{m}` is listed, but src/ has no such module"
            ));
        }
    }
    for m in &on_disk {
        if !order.contains(m) {
            problems.push(format!(
                "src/lib.rs: module `{m}` is missing from the list '{HEADING}'"
            ));
        }
    }

    let rank: HashMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let reexports = root_reexports(&lib);
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        if rel == Path::new("lib.rs") {
            continue; // the crate root: above every module
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let shown = format!("src/{}", rel.display());
        let module = file_module_path(rel);
        let top = module[0].clone();
        for (line, name) in root_references(&text, &module) {
            let target = if rank.contains_key(name.as_str()) {
                name.clone()
            } else if let Some(m) = reexports.get(&name) {
                m.clone()
            } else {
                problems.push(format!(
                    "{shown}:{line}: `crate::{name}` is neither a module nor re-exported by src/lib.rs"
                ));
                continue;
            };
            let (Some(&from), Some(&to)) = (rank.get(top.as_str()), rank.get(target.as_str()))
            else {
                continue; // reported above: not in the list
            };
            if to > from {
                let via = if target == name {
                    String::new()
                } else {
                    format!(" (`crate::{name}`)")
                };
                problems.push(format!(
                    "{shown}:{line}: `{top}` uses `{target}`{via}, which is listed after it"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the module graph breaks the order of src/lib.rs's '{HEADING}' ({} problems):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The module names of the list under the heading, in order: each item (`- `) starts
/// with the module's name, in backticks, perhaps as a link (`[`name`]`).
fn listed_modules(lib: &str) -> Vec<String> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in lib.lines() {
        let Some(doc) = line.trim_start().strip_prefix("//!") else {
            if inside {
                break;
            }
            continue;
        };
        let doc = doc.trim();
        if doc.starts_with('#') {
            if inside {
                break;
            }
            inside = doc.contains(HEADING);
            continue;
        }
        if let (true, Some(item)) = (inside, doc.strip_prefix("- ")) {
            let name: String = item
                .trim_start_matches(['[', '`'])
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
        }
    }
    out
}

/// The top modules in `src/`: `name.rs` (but `lib.rs`) and `name/mod.rs`.
fn modules_on_disk(src: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if path.is_dir() {
            if path.join("mod.rs").exists() {
                out.push(name);
            }
        } else if let Some(stem) = name.strip_suffix(".rs") {
            if stem != "lib" {
                out.push(stem.to_owned());
            }
        }
    }
    out.sort();
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/`: `a.rs` and `a/mod.rs` are `a`, `a/b.rs` is
/// `a::b`.
fn file_module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_str().unwrap().to_owned()).collect();
    let last = parts.pop().unwrap();
    if last != "mod.rs" {
        parts.push(last.trim_end_matches(".rs").to_owned());
    }
    parts
}

/// `name -> module` for the names `src/lib.rs` re-exports at the root (`pub use m::X`,
/// `pub use m::{X, Y as Z}`).
fn root_reexports(lib: &str) -> HashMap<String, String> {
    let tokens = lex(lib);
    let mut out = HashMap::new();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i].1 == Tok::Ident("use".into()) {
            if let (Some((_, Tok::Ident(m))), Some((_, Tok::Path))) =
                (tokens.get(i + 1), tokens.get(i + 2))
            {
                let mut j = i + 3;
                while j < tokens.len() && tokens[j].1 != Tok::Punct(';') {
                    if let Tok::Ident(name) = &tokens[j].1 {
                        let next = tokens.get(j + 1).map(|t| &t.1);
                        let leaf = matches!(next, Some(Tok::Punct(',' | '}' | ';')));
                        let renamed = j > 0 && tokens[j - 1].1 == Tok::Ident("as".into());
                        if (leaf || renamed) && name != "self" {
                            out.insert(name.clone(), m.clone());
                        }
                    }
                    j += 1;
                }
                i = j;
            }
        }
        i += 1;
    }
    out
}

/// `(line, name)` for every path of `text` that starts at the crate root and goes on to
/// `name`; `module` is the file's module path.
fn root_references(text: &str, module: &[String]) -> Vec<(usize, String)> {
    let tokens = lex(text);
    let mut out = Vec::new();
    let mut depth = 0usize;
    // Inline modules open here: (name, the brace depth inside them).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let (line, tok) = &tokens[i];
        match tok {
            Tok::Punct('{') => {
                depth += 1;
                if let (Some((_, Tok::Ident(m))), Some((_, Tok::Ident(name)))) = (
                    i.checked_sub(2).map(|k| &tokens[k]),
                    i.checked_sub(1).map(|k| &tokens[k]),
                ) {
                    if m == "mod" {
                        inline.push((name.clone(), depth));
                    }
                }
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(word) if word == "crate" || word == "super" => {
                let starts_path = i == 0 || tokens[i - 1].1 != Tok::Path;
                if starts_path {
                    // Where the path is after its leading `crate::` / `super::`s: the
                    // crate root or not.
                    let mut j = i;
                    let at_root = if word == "crate" {
                        j += 1;
                        tokens.get(j).map(|t| &t.1) == Some(&Tok::Path)
                    } else {
                        let mut climbs = 0;
                        while tokens.get(j).map(|t| &t.1) == Some(&Tok::Ident("super".into()))
                            && tokens.get(j + 1).map(|t| &t.1) == Some(&Tok::Path)
                        {
                            climbs += 1;
                            j += 2;
                        }
                        j -= 1; // on the last `::`
                        climbs > 0 && climbs >= module.len() + inline.len()
                    };
                    if at_root {
                        out.extend(names_after(&tokens, j + 1).into_iter().map(|n| (*line, n)));
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The first names of the path(s) at `tokens[at]`: `name`, or each item of `{a, b::c}`.
fn names_after(tokens: &[(usize, Tok)], at: usize) -> Vec<String> {
    match tokens.get(at).map(|t| &t.1) {
        Some(Tok::Ident(name)) if name != "self" => vec![name.clone()],
        Some(Tok::Punct('{')) => {
            let mut out = Vec::new();
            let mut depth = 0;
            let mut item_start = true;
            for (_, tok) in &tokens[at..] {
                match tok {
                    Tok::Punct('{') => {
                        depth += 1;
                        item_start = depth == 1;
                        continue;
                    }
                    Tok::Punct('}') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    Tok::Punct(',') if depth == 1 => {
                        item_start = true;
                        continue;
                    }
                    Tok::Ident(name) if item_start && depth == 1 && name != "self" => {
                        out.push(name.clone());
                    }
                    _ => {}
                }
                item_start = false;
            }
            out
        }
        _ => Vec::new(),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Rust source as identifiers, `::` and single punctuation characters, each with its
/// line; comments, strings, characters and lifetimes left out.
fn lex(text: &str) -> Vec<(usize, Tok)> {
    let c: Vec<char> = text.chars().collect();
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    // Skips from `c[i]` to just past `end` (a string's closing quote, after escapes).
    let skip_quoted = |mut i: usize, line: &mut usize, end: char| {
        while i < c.len() && c[i] != end {
            if c[i] == '\\' {
                i += 1;
            }
            if at(i) == '\n' {
                *line += 1;
            }
            i += 1;
        }
        i + 1
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut nest = 0;
            loop {
                if i >= c.len() {
                    break;
                }
                if c[i] == '/' && at(i + 1) == '*' {
                    nest += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    nest -= 1;
                    i += 2;
                    if nest == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_quoted(i + 1, &mut line, '"');
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                i = skip_quoted(i + 1, &mut line, '\'');
            } else if at(i + 2) == '\'' {
                i += 3; // 'x'
            } else {
                i += 1; // a lifetime: its name lexes as an identifier, harmlessly
            }
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let raw = matches!(word.as_str(), "r" | "br" | "cr");
            if raw && (at(i) == '"' || (at(i) == '#' && (at(i + 1) == '#' || at(i + 1) == '"'))) {
                // r"..." / r#"..."#: ends at a quote followed by as many #s.
                let mut hashes = 0;
                while at(i) == '#' {
                    hashes += 1;
                    i += 1;
                }
                i += 1; // the opening quote
                loop {
                    if i >= c.len() {
                        break;
                    }
                    if c[i] == '"' && (1..=hashes).all(|h| at(i + h) == '#') {
                        i += 1 + hashes;
                        break;
                    }
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            } else if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                i = skip_quoted(i + 1, &mut line, '"');
            } else if word == "b" && at(i) == '\'' {
                i = skip_quoted(i + 1, &mut line, '\'');
            } else if word == "r" && at(i) == '#' {
                i += 1; // r#ident: the identifier follows
            } else {
                out.push((line, Tok::Ident(word)));
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((line, Tok::Path));
            i += 2;
        } else if ch == '$' {
            i += 1; // `$crate` counts as `crate`
        } else {
            out.push((line, Tok::Punct(ch)));
            i += 1;
        }
    }
    out
}

/// The scan itself, on small inputs.
#[test]
fn the_scan_finds_root_paths_and_nothing_else() {
    let module = vec!["a".to_owned(), "b".to_owned()]; // src/a/b.rs
    let text = r####"
//! [`crate::doc_link`] and // crate::comment
/* crate::block /* nested */ crate::block2 */
use crate::x::Y;
use crate::{p::Q, r, self};
use super::sibling;
use super::super::z;
fn f<'a>(s: &'a str) -> char { let _ = "crate::string \" crate::escaped"; let _ = r#"crate::raw"#; let _ = '"'; let _ = '\''; '{' }
mod tests {
    use super::*;
    use super::super::sibling2;
    use super::super::super::w;
    fn g() { $crate::m!(); crate::v::f(); }
}
"####;
    let found: Vec<(usize, String)> = root_references(text, &module);
    let want: Vec<(usize, String)> = vec![
        (4, "x".into()),
        (5, "p".into()),
        (5, "r".into()),
        (7, "z".into()),
        (12, "w".into()),
        (13, "m".into()),
        (13, "v".into()),
    ];
    assert_eq!(found, want);

    let lib = "//! # Modules, lowest first\n//! Text.\n//! - [`a`]: one;\n//! - `b_c` (internal): two\n//!\n//! # Next\n//! - `not`\npub use a::{X, Y as Z};\npub use b_c::W;\n";
    assert_eq!(listed_modules(lib), ["a", "b_c"]);
    let re = root_reexports(lib);
    assert_eq!(re.get("X").map(String::as_str), Some("a"));
    assert_eq!(re.get("Z").map(String::as_str), Some("a"));
    assert_eq!(re.get("W").map(String::as_str), Some("b_c"));
    assert_eq!(re.get("Y"), None);
}
