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

const UI_INDEX: &str = include_str!("../../../ui/index.html");
const UI_SCRIPT: &str = include_str!("../../../ui/viewer.js");
const UI_STYLE: &str = include_str!("../../../ui/viewer.css");

/// The viewer's routes (`/`, `/index.html` and its script and style), for
/// the API's router to merge; they read no state.
pub(super) fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    Router::new()
        .route("/", get(ui_index))
        .route("/index.html", get(ui_index))
        .route("/viewer.js", get(ui_script))
        .route("/viewer.css", get(ui_style))
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

async fn ui_index() -> Response {
    static_file("text/html; charset=utf-8", UI_INDEX)
}

async fn ui_script() -> Response {
    static_file("text/javascript; charset=utf-8", UI_SCRIPT)
}

async fn ui_style() -> Response {
    static_file("text/css; charset=utf-8", UI_STYLE)
}
