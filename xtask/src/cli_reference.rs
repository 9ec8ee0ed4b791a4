//! The reference pages under `docs/reference/` that are rendered from the
//! code: a command's flags from its clap definition, and the check that a
//! committed page is what the code renders now.
//!
//! Shared by path (`#[path]`) with the tests of each binary that has a
//! command line (`ringwatch-agent`, `collbench`, `ringwatch-report`), which
//! render their own page, and by `cargo xtask reference`, which asks those
//! tests to write them. It only renders and compares text.

#![allow(dead_code)] // each includer uses its part

use std::fmt::Write as _;
use std::path::Path;

/// Set to `1`, the page tests write the pages instead of comparing them.
pub const UPDATE_VARIABLE: &str = "RINGWATCH_UPDATE_REFERENCE";

/// The Markdown page of the command `name` (the binary's name) and its
/// subcommands: per command its description, usage and a table of flags
/// with their environment variable and default.
pub fn render_cli(command: &clap::Command, name: &'static str) -> String {
    let mut command = command.clone().name(name).bin_name(name);
    command.build();
    let mut page = String::new();
    let name = name.to_owned();
    let _ = writeln!(
        page,
        "# `{name}`\n\n<!-- Rendered from the clap definitions by `cargo xtask reference`; do not edit. -->\n"
    );
    render_command(&mut page, &command, &name, true);
    page
}

fn render_command(page: &mut String, command: &clap::Command, path: &str, root: bool) {
    if !root {
        let _ = writeln!(page, "## `{path}`\n");
    }
    if let Some(about) = command.get_long_about().or(command.get_about()) {
        let _ = writeln!(page, "{}\n", about.to_string().trim());
    }
    let usage = command.clone().render_usage().to_string();
    let _ = writeln!(page, "```text\n{}\n```\n", usage.trim());
    let args: Vec<&clap::Arg> = command
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .filter(|a| root || !a.is_global_set())
        .collect();
    if !args.is_empty() {
        page.push_str("| flag | environment | default | what it does |\n|---|---|---|---|\n");
        for arg in args {
            let _ = writeln!(
                page,
                "| {} | {} | {} | {} |",
                flag(arg),
                arg.get_env()
                    .map(|e| format!("`{}`", e.to_string_lossy()))
                    .unwrap_or_default(),
                defaults(arg),
                cell(&help(arg)),
            );
        }
        page.push('\n');
    }
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        render_command(page, sub, &format!("{path} {}", sub.get_name()), false);
    }
}

fn flag(arg: &clap::Arg) -> String {
    let value = arg
        .get_value_names()
        .map(|names| names.iter().map(|n| format!(" <{n}>")).collect::<String>())
        .unwrap_or_default();
    let takes_value = arg.get_action().takes_values();
    let value = if takes_value && value.is_empty() {
        format!(" <{}>", arg.get_id().as_str().to_uppercase())
    } else if takes_value {
        value
    } else {
        String::new()
    };
    match (arg.get_long(), arg.get_short()) {
        (Some(long), Some(short)) => format!("`-{short}`, `--{long}{value}`"),
        (Some(long), None) => format!("`--{long}{value}`"),
        (None, Some(short)) => format!("`-{short}{value}`"),
        (None, None) => format!("`{}`", value.trim()),
    }
}

fn defaults(arg: &clap::Arg) -> String {
    let values: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if values.is_empty() || !arg.get_action().takes_values() {
        return String::new();
    }
    format!("`{}`", values.join(","))
}

fn help(arg: &clap::Arg) -> String {
    let mut text = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    let possible: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|p| !p.is_hide_set())
        .map(|p| match p.get_help() {
            Some(h) => format!(
                "`{}` ({})",
                p.get_name(),
                h.to_string().trim_end_matches('.')
            ),
            None => format!("`{}`", p.get_name()),
        })
        .collect();
    if !possible.is_empty() && !text.contains("possible values") {
        let text_so_far = text.trim_end();
        let stop = if text_so_far.is_empty() || text_so_far.ends_with(['.', ')', ':']) {
            ""
        } else {
            "."
        };
        text = format!("{text_so_far}{stop} One of: {}.", possible.join(", "));
    }
    text
}

/// One table cell: a paragraph's lines joined, `|` escaped.
pub fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// Compares the committed page at `path` with `rendered`, or writes it when
/// [`UPDATE_VARIABLE`] is `1`. Panics (it is for tests) with the command
/// that brings the page up to date.
pub fn check_page(path: &Path, rendered: &str) {
    if std::env::var(UPDATE_VARIABLE).as_deref() == Ok("1") {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("the docs/reference folder can be created");
        }
        std::fs::write(path, rendered).expect("the reference page can be written");
        return;
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    if committed != rendered {
        let first = committed
            .lines()
            .zip(rendered.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(rendered.lines().count()));
        panic!(
            "{} is not what the code renders now (first difference at line {}: committed {:?}, \
             rendered {:?}); run `cargo xtask reference` and commit the page",
            path.display(),
            first + 1,
            committed.lines().nth(first).unwrap_or("<end>"),
            rendered.lines().nth(first).unwrap_or("<end>"),
        );
    }
}
