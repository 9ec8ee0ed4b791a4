//! `api::ui`: the timeline viewer (`ui/`), embedded at build time and served
//! as static files: the agent serves it with no files beside the binary and
//! nothing fetched from elsewhere.
//!
//! It never reads the agent's state; the viewer asks the JSON API like any
//! other client.

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const HTML: &str = "text/html; charset=utf-8";
// ES modules must come with a JavaScript type, or browsers refuse to run them.
const JAVASCRIPT: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

const UI_INDEX: &str = include_str!("../../../ui/index.html");

/// One file of `ui/`, served at its path under `ui/`.
macro_rules! ui_file {
    ($path:literal, $content_type:expr) => {
        (
            concat!("/", $path),
            $content_type,
            include_str!(concat!("../../../ui/", $path)),
        )
    };
}

/// Every file the page loads, by the path it is served at, with its type:
/// the entry module (`viewer.js`), the modules it imports (`js/`, the
/// parser's Worker among them) and the style. A module added to `ui/js/`
/// goes here too; `every_viewer_module_is_served` checks that.
const UI_FILES: &[(&str, &str, &str)] = &[
    ui_file!("viewer.js", JAVASCRIPT),
    ui_file!("js/format.js", JAVASCRIPT),
    ui_file!("js/interact.js", JAVASCRIPT),
    ui_file!("js/layout.js", JAVASCRIPT),
    ui_file!("js/overview.js", JAVASCRIPT),
    ui_file!("js/parse.js", JAVASCRIPT),
    ui_file!("js/render.js", JAVASCRIPT),
    ui_file!("js/search.js", JAVASCRIPT),
    ui_file!("js/source.js", JAVASCRIPT),
    ui_file!("js/timeline.js", JAVASCRIPT),
    ui_file!("js/tuning.js", JAVASCRIPT),
    ui_file!("js/worker.js", JAVASCRIPT),
    ui_file!("viewer.css", CSS),
];

/// The viewer's routes (`/`, `/index.html` and every file of [`UI_FILES`]),
/// for the API's router to merge; they read no state.
pub(super) fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let index = || async { static_file(HTML, UI_INDEX) };
    let mut router = Router::new()
        .route("/", get(index))
        .route("/index.html", get(index));
    for &(path, content_type, body) in UI_FILES {
        router = router.route(
            path,
            get(move || async move { static_file(content_type, body) }),
        );
    }
    router
}

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::UI_FILES;
    use std::path::Path;

    /// A module in `ui/js/` that is not embedded would be a 404 for the page
    /// the agent serves (its import fails, and with it the whole viewer).
    #[test]
    fn every_viewer_module_is_served() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ui/js");
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
        for entry in entries {
            let name = entry.expect("a readable directory entry").file_name();
            let name = name.to_string_lossy();
            if !name.ends_with(".js") {
                continue;
            }
            let path = format!("/js/{name}");
            assert!(
                UI_FILES.iter().any(|&(p, _, _)| p == path),
                "ui/js/{name} is not in api::ui::UI_FILES: add it there so the agent serves it"
            );
        }
    }

    /// Every module a served file names (`import … from './x.js'`,
    /// `import('./x.js')`, the Worker's `new URL('./worker.js', …)`) is
    /// served too.
    #[test]
    fn every_import_is_served() {
        for &(path, _, body) in UI_FILES {
            let base = &path[..=path.rfind('/').expect("served paths start with /")];
            for piece in body.split("'./").skip(1) {
                let Some(relative) = piece.split('\'').next().filter(|r| r.ends_with(".js")) else {
                    continue;
                };
                let wanted = format!("{base}{relative}");
                assert!(
                    UI_FILES.iter().any(|&(p, _, _)| p == wanted),
                    "{path} loads ./{relative} ({wanted}), which api::ui does not serve"
                );
            }
        }
    }
}
