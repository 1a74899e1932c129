//! The [`Router`]: shared state, the axum app (routes and layers) and the server loop with
//! graceful shutdown.

use std::future::{Future, IntoFuture};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::{from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use kvmesh_prompt::tokenizer::Tokenizer;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower_http::catch_panic::CatchPanicLayer;

use crate::admission::{self, Admission};
use crate::auth::{self, ApiKeys};
use crate::backend::Backend;
use crate::config::{ConfigError, RouterConfig};
use crate::error::ApiError;
use crate::metrics;
use crate::openai::{self, chat, completions, models, responses, tokenize};
use crate::prompt::Prompts;
use crate::rate_limit::{self, RateLimiter};
use crate::request_id;
use crate::sse::panic_message;

/// What every handler shares.
pub(crate) struct AppState {
    pub(crate) config: RouterConfig,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) prompts: Prompts,
    pub(crate) admission: Arc<Admission>,
    pub(crate) draining: AtomicBool,
    /// Set when the shutdown timeout expires: in-flight generations end with a 503.
    pub(crate) abort: watch::Sender<bool>,
    pub(crate) started_unix: u64,
}

/// The HTTP gateway. Cheap to clone; clones share the drain flag.
///
/// Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`,
/// `GET /v1/models` (these behind API-key auth when keys are configured), `GET /health`,
/// `GET /metrics`.
#[derive(Clone)]
pub struct Router {
    state: Arc<AppState>,
    keys: Arc<ApiKeys>,
    /// `None`: no rate limit.
    rate_limiter: Option<Arc<RateLimiter>>,
}

impl Router {
    /// Validates `config`, hashes its API keys and compiles the tokenizer's chat template (a
    /// model without a usable template still serves `/v1/completions`).
    pub fn new(
        config: RouterConfig,
        backend: Arc<dyn Backend>,
        tokenizer: Arc<Tokenizer>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        // The recorder and every unlabelled router series exist from the start (scrapes
        // list them before the first request).
        metrics::metrics();
        let keys = Arc::new(ApiKeys::new(&config.api_keys));
        let rate_limiter =
            RateLimiter::new(&keys, config.rate_limit_per_second, config.rate_limit_burst)
                .map(Arc::new);
        let admission = Admission::new(config.ttft_target, config.max_in_flight);
        Ok(Router {
            state: Arc::new(AppState {
                config,
                backend,
                prompts: Prompts::new(tokenizer),
                admission,
                draining: AtomicBool::new(false),
                abort: watch::Sender::new(false),
                started_unix: openai::unix_now(),
            }),
            keys,
            rate_limiter,
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.state.config
    }

    /// While draining, `/health` answers 503 so load balancers stop sending traffic;
    /// requests that still arrive are served.
    pub fn set_draining(&self, draining: bool) {
        self.state.draining.store(draining, Ordering::Relaxed);
    }

    pub fn is_draining(&self) -> bool {
        self.state.draining.load(Ordering::Relaxed)
    }

    /// The axum application (for `axum::serve`, or `tower::ServiceExt::oneshot` in tests).
    pub fn app(&self) -> axum::Router {
        // Rate limits and admission apply to the completion routes only (listing models
        // costs nothing). Layers run outside in: metrics, auth, rate limit, admission.
        let api = axum::Router::new()
            .route("/v1/chat/completions", post(chat::handle))
            .route("/v1/completions", post(completions::handle))
            .route("/v1/responses", post(responses::handle))
            .route_layer(from_fn_with_state(
                self.state.admission.clone(),
                admission::shed,
            ))
            .route_layer(from_fn_with_state(
                self.rate_limiter.clone(),
                rate_limit::limit,
            ))
            .route("/v1/models", get(models::list))
            .route("/tokenize", post(tokenize::tokenize))
            .route("/detokenize", post(tokenize::detokenize))
            .method_not_allowed_fallback(method_not_allowed)
            .route_layer(from_fn_with_state(self.keys.clone(), auth::require_api_key))
            .route_layer(from_fn(metrics::track));
        let ops = axum::Router::new()
            .route("/health", get(health))
            .route("/metrics", get(metrics::render))
            .route("/openapi.json", get(openapi))
            .method_not_allowed_fallback(method_not_allowed);
        api.merge(ops)
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(self.state.config.max_body_bytes))
            .layer(CatchPanicLayer::custom(panic_response))
            .layer(from_fn(request_id::assign))
            .with_state(self.state.clone())
    }

    /// Serves on `listener` until `shutdown` completes; then stops accepting, marks the
    /// router draining and lets in-flight requests finish. Requests still running after
    /// `config.shutdown_timeout` are ended with a 503 (an error event for streams), which
    /// cancels them at the backend; connections still open a moment later are left behind.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> io::Result<()> {
        let app = self.app();
        let timeout = self.state.config.shutdown_timeout;
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        let router = self.clone();
        let signal = async move {
            shutdown.await;
            router.set_draining(true);
            tracing::info!("shutting down: finishing in-flight requests");
            let _ = started_tx.send(());
        };
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, model = %self.state.config.model_name, "router listening");
        }
        let server = axum::serve(listener, app)
            .with_graceful_shutdown(signal)
            .into_future();
        tokio::pin!(server);
        let deadline = async move {
            match started_rx.await {
                Ok(()) => tokio::time::sleep(timeout).await,
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            result = &mut server => return result,
            () = deadline => {}
        }
        tracing::warn!(
            ?timeout,
            "shutdown timeout: aborting requests still in flight"
        );
        self.state.abort.send_replace(true);
        match tokio::time::timeout(ABORT_GRACE, server).await {
            Ok(result) => result,
            Err(_) => {
                tracing::warn!("connections still open after aborting; not waiting for them");
                Ok(())
            }
        }
    }
}

/// After aborting in-flight requests, how long `serve` waits for their connections.
const ABORT_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// The API's OpenAPI 3.1 document (`router/openapi/openapi.json`).
const OPENAPI: &str = include_str!("../openapi/openapi.json");

/// `GET /openapi.json`.
async fn openapi() -> impl axum::response::IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
}

/// `GET /health`: 200 when the backend is ready and the router is not draining.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let (status, text) = if state.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if !state.backend.is_ready() {
        (StatusCode::SERVICE_UNAVAILABLE, "not_ready")
    } else {
        (StatusCode::OK, "ok")
    };
    (status, Json(json!({ "status": text }))).into_response()
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

/// A handler panic becomes a logged 500 with an OpenAI body, not a dropped connection.
fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    ApiError::Internal(format!("handler panicked: {}", panic_message(&*panic))).into_response()
}
