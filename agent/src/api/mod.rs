//! `api`: the agent's HTTP API (axum): what the agent knows, as JSON for
//! people and scripts, and as Prometheus exposition at `/metrics`; tuning
//! sessions started and stopped; the embedded timeline viewer.
//!
//! Handlers only read shared state and format it; they never touch BPF or a
//! job directly (tuning sessions run on their own threads in `tuning`).
//! Every error is JSON with the right status, the framework's own
//! rejections (a malformed query or path, a body over the limit) included;
//! unknown query parameters are rejected, never ignored. Mutating endpoints
//! (POST, DELETE) pass [`Auth`] first: a bearer token when one is
//! configured, and never without one when the API listens beyond loopback.
//! Timeline queries are bounded ([`TimelineLimits`]). The OpenAPI document
//! is derived from the handlers (`openapi`), never written by hand.
//!
//! Code map: `auth` (who may change things), `extract` (errors and typed
//! input), `node` (read-only answers), `timeline`, `tuning` (sessions and
//! reports), `shapes` (the document's shapes of outside types), `openapi`
//! (the document), `ui` (the viewer's files), `http` (connections).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use tower_http::limit::RequestBodyLimitLayer;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

mod auth;
mod diagnosis;
mod extract;
pub mod http;
mod node;
mod openapi;
mod shapes;
mod timeline;
mod tuning;
mod ui;

pub use auth::Auth;
pub use extract::{ApiError, MAX_BODY_BYTES};
pub use timeline::TimelineLimits;

use crate::cluster::Cluster;
use crate::gpu::Gpus;
use crate::jobs::Jobs;
use crate::live::LiveView;
use crate::timeline::RecordedTrace;
use crate::tuning::TuningSessions;

/// What the handlers read. Cheap to clone (everything behind `Arc`).
#[derive(Clone)]
pub struct ApiState {
    /// This node among its peers (`--node-name`, `--peers`, `--peers-dns`).
    pub cluster: Arc<Cluster>,
    /// The eBPF figures tuning windows are judged by (with eBPF), also
    /// answered to peers tuning a multi-node job (`/api/jobs/{id}/load`).
    pub load_feed: Option<Arc<crate::tuning::LoadFeed>>,
    /// The node's GPUs (NVML), or why there are none.
    pub gpus: Arc<Gpus>,
    /// When the agent started, for `/api/health`.
    pub started: Instant,
    /// A recorded trace served by `/api/timeline` (`serve --replay`).
    pub recorded: Option<Arc<RecordedTrace>>,
    /// The most events one `/api/timeline` answer may carry.
    pub timeline_event_limit: usize,
    /// The latest view of the live eBPF pipeline (`serve --pid …`), replaced
    /// whole once a second.
    pub live: Arc<Mutex<Option<Arc<LiveView>>>>,
    /// The jobs found through control sockets (`serve --jobs`), with or
    /// without eBPF.
    pub jobs: Option<Jobs>,
    /// Tuning sessions and their reports (`serve --jobs`).
    pub tunings: Option<Arc<TuningSessions>>,
    /// Who may call the mutating endpoints.
    pub auth: Arc<Auth>,
    /// The records of the node's NCCL profiler plugins (`serve --jobs`).
    pub nccl: Option<crate::nccl_profiler::NcclProfiler>,
}

impl ApiState {
    /// Replaces the live view.
    pub fn publish(&self, view: LiveView) {
        let mut slot = self
            .live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *slot = Some(Arc::new(view));
    }

    /// The live view, if the pipeline runs and has published one.
    pub fn live_view(&self) -> Option<Arc<LiveView>> {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The router: every endpoint of the API, with the default
/// [`TimelineLimits`].
pub fn router(state: ApiState) -> Router {
    router_with(state, TimelineLimits::default())
}

/// The router with these timeline limits. Every answer that is an error is
/// JSON (`json_errors` is the outermost layer, so the body limit's 413
/// is too).
pub fn router_with(state: ApiState, limits: TimelineLimits) -> Router {
    let (api, _) = routes(limits).split_for_parts();
    api.merge(ui::routes())
        .fallback(extract::not_found)
        .method_not_allowed_fallback(extract::method_not_allowed)
        .layer(RequestBodyLimitLayer::new(MAX_BODY_BYTES))
        .layer(axum::middleware::map_response(extract::json_errors))
        .with_state(state)
}

/// Every documented route, each mounted from its handler's
/// `#[utoipa::path]` (method and path), with the document they make.
fn routes(limits: TimelineLimits) -> OpenApiRouter<ApiState> {
    let slots = timeline::TimelineSlots::new(limits);
    let (schemas, paths, timeline) = routes!(timeline::timeline);
    OpenApiRouter::with_openapi(openapi::top())
        .routes(routes!(node::health))
        .routes(routes!(node::gpus))
        .routes(routes!(node::jobs))
        .routes(routes!(node::processes))
        .routes((schemas, paths, timeline.layer(axum::Extension(slots))))
        .routes(routes!(node::clock))
        .routes(routes!(tuning::job_load))
        .routes(routes!(diagnosis::job_diagnosis))
        .routes(routes!(node::cluster_jobs))
        .routes(routes!(
            tuning::tuning_get,
            tuning::tuning_post,
            tuning::tuning_delete
        ))
        .routes(routes!(tuning::reports_list))
        .routes(routes!(tuning::report_file))
        .routes(routes!(openapi::openapi))
        .routes(routes!(node::nccl_collectives))
        .routes(routes!(node::metrics))
}

#[cfg(test)]
mod tests;
