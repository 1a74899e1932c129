//! The gRPC protocol (`proto/kvmesh.proto`) and its conversions to and from the shared
//! types. Messages from the network are untrusted: every conversion that can meet a value
//! the proto allows but our types do not returns a [`WireError`] instead of guessing.

use crate::ids::{NodeId, RequestId, TokenId};
use crate::protocol::{GenerateEvent, GenerateRequest, LoadReport, TokenEvent, Usage, WorkerError};
use crate::sampling::{FinishReason, SamplingParams};

/// Generated messages, clients (`decode_client`, `prefill_client`) and servers.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("kvmesh.v1");
}

/// The metadata key that carries a request id on every RPC (for logs and tracing).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// After this long without a frame from the peer, a node channel (client or server side)
/// sends an HTTP/2 PING. A peer that is stopped (`SIGSTOP`), wedged or cut off keeps its TCP
/// socket open and answers no PING: the connection, and every call on it, fails
/// [`KEEPALIVE_TIMEOUT`] later instead of waiting for the call's deadline (a stream's
/// deadline is minutes). Tokio answers PINGs even while a node's engine thread computes.
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a PING may go unanswered before the connection is taken as dead.
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// A message that is well-formed protobuf but not a valid kvmesh message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {message}: {reason}")]
pub struct WireError {
    pub message: &'static str,
    pub reason: String,
}

impl WireError {
    pub fn missing(message: &'static str, field: &str) -> Self {
        WireError {
            message,
            reason: format!("field `{field}` is missing"),
        }
    }
}

impl From<WireError> for tonic::Status {
    fn from(e: WireError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// Puts `id` into a request's metadata.
pub fn tag_request<T>(request: &mut tonic::Request<T>, id: RequestId) {
    if let Ok(v) = id.to_string().parse() {
        request.metadata_mut().insert(REQUEST_ID_HEADER, v);
    }
}

/// The time left to a call, from its `grpc-timeout` header (gRPC's wire format: up to 8
/// digits and a unit, `H`, `M`, `S`, `m`, `u` or `n`); `None` when absent or malformed.
pub fn timeout_of(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    use std::time::Duration;
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

impl From<&SamplingParams> for pb::SamplingParams {
    fn from(p: &SamplingParams) -> Self {
        pb::SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            logit_bias: p
                .logit_bias
                .iter()
                .map(|&(token, bias)| pb::LogitBias { token, bias })
                .collect(),
            stop_token_ids: p.stop_token_ids.clone(),
            stop: p.stop.clone(),
            max_tokens: p.max_tokens,
            min_tokens: p.min_tokens,
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs,
            constraint: p
                .constraint
                .as_ref()
                .map(|c| serde_json::to_string(c).expect("a constraint serializes")),
        }
    }
}

impl TryFrom<pb::SamplingParams> for SamplingParams {
    type Error = serde_json::Error;

    /// Every field maps; ranges are checked by `SamplingParams::validate` where the request is
    /// accepted, exactly as for a local request. Fails on a constraint that is not one.
    fn try_from(p: pb::SamplingParams) -> Result<Self, serde_json::Error> {
        let constraint = p
            .constraint
            .as_deref()
            .map(serde_json::from_str)
            .transpose()?;
        Ok(SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            seed: p.seed,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            logit_bias: p.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
            stop_token_ids: p.stop_token_ids,
            stop: p.stop,
            max_tokens: p.max_tokens,
            min_tokens: p.min_tokens,
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs,
            constraint,
        })
    }
}

/// The parameters of a message, which must be present.
pub fn params_from(
    message: &'static str,
    p: Option<pb::SamplingParams>,
) -> Result<SamplingParams, WireError> {
    let p = p.ok_or_else(|| WireError::missing(message, "params"))?;
    SamplingParams::try_from(p).map_err(|e| WireError {
        message,
        reason: format!("params.constraint: {e}"),
    })
}

/// A prefill node the decode node should use: which, and where it listens (the decode node
/// connects to it and holds it as a `kvmesh_worker::PrefillTarget`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillNode {
    pub node_id: NodeId,
    /// host:port of its control plane.
    pub address: String,
}

/// A node holding more of the prompt's leading blocks than the decode node, which may pull
/// them from there (`KvCache.Export`) instead of recomputing them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvHolder {
    pub node_id: NodeId,
    /// host:port of its control plane.
    pub address: String,
    /// Leading prompt blocks it holds, by the prefix index.
    pub blocks: usize,
}

/// Where the router wants a request's prompt KV to come from, besides the decode node's own
/// prefix cache: a prefill node (`None`: prefill on the decode node) and a holder to pull
/// cached blocks from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub prefill: Option<PrefillNode>,
    pub pull: Option<KvHolder>,
}

impl From<PrefillNode> for Placement {
    fn from(prefill: PrefillNode) -> Self {
        Placement {
            prefill: Some(prefill),
            pull: None,
        }
    }
}

/// `Generate`'s message: the request and where its prompt KV comes from.
pub fn generate_request_to_pb(req: &GenerateRequest, placement: &Placement) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: req.request_id.0,
        prompt: req.prompt.clone(),
        params: Some((&req.params).into()),
        resume: req.resume.clone(),
        prefill: placement.prefill.as_ref().map(|p| pb::PrefillNode {
            node_id: p.node_id.0,
            address: p.address.clone(),
        }),
        pull: placement.pull.as_ref().map(|h| pb::KvHolder {
            node_id: h.node_id.0,
            address: h.address.clone(),
            blocks: u32::try_from(h.blocks).unwrap_or(u32::MAX),
        }),
    }
}

pub fn generate_request_from_pb(
    m: pb::GenerateRequest,
) -> Result<(GenerateRequest, Placement), WireError> {
    let params = params_from("GenerateRequest", m.params)?;
    let placement = Placement {
        prefill: m.prefill.map(|p| PrefillNode {
            node_id: NodeId(p.node_id),
            address: p.address,
        }),
        pull: m.pull.map(|h| KvHolder {
            node_id: NodeId(h.node_id),
            address: h.address,
            blocks: h.blocks as usize,
        }),
    };
    let req = GenerateRequest {
        request_id: RequestId(m.request_id),
        prompt: m.prompt,
        params,
        resume: m.resume,
    };
    Ok((req, placement))
}

pub fn logprobs_to_pb(top: &[(TokenId, f32)]) -> Vec<pb::TokenLogprob> {
    top.iter()
        .map(|&(token, logprob)| pb::TokenLogprob { token, logprob })
        .collect()
}

pub fn logprobs_from_pb(top: &[pb::TokenLogprob]) -> Vec<(TokenId, f32)> {
    top.iter().map(|t| (t.token, t.logprob)).collect()
}

impl From<FinishReason> for pb::FinishReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Stop => pb::FinishReason::Stop,
            FinishReason::Length => pb::FinishReason::Length,
            FinishReason::Cancelled => pb::FinishReason::Cancelled,
        }
    }
}

impl From<&WorkerError> for pb::WorkerError {
    fn from(e: &WorkerError) -> Self {
        let (kind, message) = match e {
            WorkerError::InvalidRequest(m) => (pb::WorkerErrorKind::InvalidRequest, m),
            WorkerError::Overloaded(m) => (pb::WorkerErrorKind::Overloaded, m),
            WorkerError::Unavailable(m) => (pb::WorkerErrorKind::Unavailable, m),
            WorkerError::Internal(m) => (pb::WorkerErrorKind::Internal, m),
        };
        pb::WorkerError {
            kind: kind.into(),
            message: message.clone(),
        }
    }
}

impl From<pb::WorkerError> for WorkerError {
    fn from(e: pb::WorkerError) -> Self {
        match pb::WorkerErrorKind::try_from(e.kind) {
            Ok(pb::WorkerErrorKind::InvalidRequest) => WorkerError::InvalidRequest(e.message),
            Ok(pb::WorkerErrorKind::Overloaded) => WorkerError::Overloaded(e.message),
            Ok(pb::WorkerErrorKind::Unavailable) => WorkerError::Unavailable(e.message),
            _ => WorkerError::Internal(e.message),
        }
    }
}

/// How a refusal travels as a gRPC status, so the router can still tell 400 from 429/503.
impl From<WorkerError> for tonic::Status {
    fn from(e: WorkerError) -> Self {
        match e {
            WorkerError::InvalidRequest(m) => tonic::Status::invalid_argument(m),
            WorkerError::Overloaded(m) => tonic::Status::resource_exhausted(m),
            WorkerError::Unavailable(m) => tonic::Status::unavailable(m),
            WorkerError::Internal(m) => tonic::Status::internal(m),
        }
    }
}

/// The inverse of `From<WorkerError> for Status`; transport failures (the node is down,
/// unreachable, or timed out) are `Unavailable`, so the router may retry elsewhere.
pub fn worker_error_from_status(s: &tonic::Status) -> WorkerError {
    use tonic::Code;
    let m = s.message().to_string();
    match s.code() {
        Code::InvalidArgument | Code::OutOfRange => WorkerError::InvalidRequest(m),
        Code::ResourceExhausted => WorkerError::Overloaded(m),
        // tonic reports a connection that broke under a call (the node died) as UNKNOWN
        // "transport error"; our servers never send UNKNOWN themselves.
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Aborted
        | Code::Unknown => WorkerError::Unavailable(m),
        _ => WorkerError::Internal(format!("{:?}: {m}", s.code())),
    }
}

impl From<&GenerateEvent> for pb::GenerateEvent {
    fn from(e: &GenerateEvent) -> Self {
        use pb::generate_event::Event;
        let event = match e {
            GenerateEvent::Token(t) => Event::Token(pb::TokenEvent {
                token: t.token,
                text: t.text.clone(),
                logprob: t.logprob,
                top_logprobs: logprobs_to_pb(&t.top_logprobs),
            }),
            GenerateEvent::Finished {
                reason,
                text,
                usage,
            } => Event::Finished(pb::Finished {
                reason: pb::FinishReason::from(*reason).into(),
                text: text.clone(),
                usage: Some(pb::Usage {
                    prompt_tokens: usage.prompt_tokens,
                    completion_tokens: usage.completion_tokens,
                    cached_tokens: usage.cached_tokens,
                }),
            }),
            GenerateEvent::Error(e) => Event::Error(e.into()),
        };
        pb::GenerateEvent { event: Some(event) }
    }
}

impl TryFrom<pb::GenerateEvent> for GenerateEvent {
    type Error = WireError;

    fn try_from(e: pb::GenerateEvent) -> Result<Self, WireError> {
        use pb::generate_event::Event;
        const M: &str = "GenerateEvent";
        Ok(
            match e.event.ok_or_else(|| WireError::missing(M, "event"))? {
                Event::Token(t) => GenerateEvent::Token(TokenEvent {
                    token: t.token,
                    text: t.text,
                    logprob: t.logprob,
                    top_logprobs: logprobs_from_pb(&t.top_logprobs),
                }),
                Event::Finished(f) => {
                    let reason = match pb::FinishReason::try_from(f.reason) {
                        Ok(pb::FinishReason::Stop) => FinishReason::Stop,
                        Ok(pb::FinishReason::Length) => FinishReason::Length,
                        Ok(pb::FinishReason::Cancelled) => FinishReason::Cancelled,
                        _ => {
                            return Err(WireError {
                                message: M,
                                reason: format!("unknown finish reason {}", f.reason),
                            })
                        }
                    };
                    let u = f.usage.ok_or_else(|| WireError::missing(M, "usage"))?;
                    GenerateEvent::Finished {
                        reason,
                        text: f.text,
                        usage: Usage {
                            prompt_tokens: u.prompt_tokens,
                            completion_tokens: u.completion_tokens,
                            cached_tokens: u.cached_tokens,
                        },
                    }
                }
                Event::Error(e) => GenerateEvent::Error(e.into()),
            },
        )
    }
}

/// A node's answer to `Health`.
pub fn health_reply(
    node: NodeId,
    serving: bool,
    load: LoadReport,
    requests_total: u64,
) -> pb::HealthReply {
    pb::HealthReply {
        node_id: node.0,
        serving,
        load: Some((&load).into()),
        requests_total,
        role: pb::NodeRole::Unspecified as i32,
    }
}

/// The wire form of a worker role (`Router` has none: it is never a node's worker role).
pub fn node_role_to_pb(role: crate::protocol::NodeRole) -> pb::NodeRole {
    use crate::protocol::NodeRole;
    match role {
        NodeRole::Prefill => pb::NodeRole::Prefill,
        NodeRole::Decode => pb::NodeRole::Decode,
        NodeRole::Router => pb::NodeRole::Unspecified,
    }
}

/// A worker role from the wire: prefill or decode, nothing else.
pub fn node_role_from_pb(
    message: &'static str,
    role: i32,
) -> Result<crate::protocol::NodeRole, WireError> {
    use crate::protocol::NodeRole;
    match pb::NodeRole::try_from(role) {
        Ok(pb::NodeRole::Prefill) => Ok(NodeRole::Prefill),
        Ok(pb::NodeRole::Decode) => Ok(NodeRole::Decode),
        _ => Err(WireError {
            message,
            reason: format!(
                "role {role} is neither prefill ({}) nor decode ({})",
                pb::NodeRole::Prefill as i32,
                pb::NodeRole::Decode as i32
            ),
        }),
    }
}

impl From<&LoadReport> for pb::LoadReport {
    fn from(l: &LoadReport) -> Self {
        pb::LoadReport {
            running: l.running as u64,
            waiting: l.waiting as u64,
            kv_blocks_used: l.kv_blocks_used as u64,
            queued_prompt_tokens: l.queued_prompt_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_requests_round_trip() {
        let req = GenerateRequest {
            request_id: RequestId(42),
            prompt: vec![1, 2, 3],
            params: SamplingParams {
                seed: Some(7),
                logit_bias: vec![(5, -1.5)],
                stop: vec!["\n\n".into()],
                logprobs: Some(2),
                constraint: Some(crate::Constraint::JsonSchema {
                    schema: serde_json::json!({"type": "object", "required": ["a"]}),
                }),
                ..SamplingParams::greedy(9)
            },
            resume: vec![4, 5],
        };
        let placement = Placement {
            prefill: Some(PrefillNode {
                node_id: NodeId(3),
                address: "127.0.0.2:7000".into(),
            }),
            pull: Some(KvHolder {
                node_id: NodeId(4),
                address: "127.0.0.3:7000".into(),
                blocks: 62,
            }),
        };
        let wire = generate_request_to_pb(&req, &placement);
        let (back, placement_back) = generate_request_from_pb(wire).unwrap();
        assert_eq!(back, req);
        assert_eq!(placement_back, placement);
        let (_, none) =
            generate_request_from_pb(generate_request_to_pb(&req, &Placement::default())).unwrap();
        assert_eq!(none, Placement::default());
        // A constraint that is not one is refused, not dropped.
        let mut bad = generate_request_to_pb(&req, &placement);
        bad.params.as_mut().unwrap().constraint = Some("{\"type\": \"yaml\"}".into());
        let e = generate_request_from_pb(bad).unwrap_err();
        assert!(e.to_string().contains("constraint"), "{e}");
    }

    #[test]
    fn events_round_trip_and_bad_ones_are_refused() {
        let events = [
            GenerateEvent::Token(TokenEvent {
                token: 9,
                text: "hi".into(),
                logprob: Some(-0.5),
                top_logprobs: vec![(9, -0.5), (4, -1.0)],
            }),
            GenerateEvent::Finished {
                reason: FinishReason::Length,
                text: String::new(),
                usage: Usage {
                    prompt_tokens: 3,
                    completion_tokens: 2,
                    cached_tokens: 1,
                },
            },
            GenerateEvent::Error(WorkerError::Overloaded("busy".into())),
        ];
        for e in events {
            assert_eq!(GenerateEvent::try_from(pb::GenerateEvent::from(&e)), Ok(e));
        }
        assert!(GenerateEvent::try_from(pb::GenerateEvent { event: None }).is_err());
        let bad_reason = pb::GenerateEvent {
            event: Some(pb::generate_event::Event::Finished(pb::Finished {
                reason: 99,
                text: String::new(),
                usage: Some(pb::Usage::default()),
            })),
        };
        assert!(GenerateEvent::try_from(bad_reason).is_err());
        let missing_params = pb::GenerateRequest::default();
        assert!(generate_request_from_pb(missing_params).is_err());
    }

    #[test]
    fn grpc_timeouts_parse_and_bad_ones_are_ignored() {
        use std::time::Duration;
        let mut request = tonic::Request::new(());
        assert_eq!(timeout_of(request.metadata()), None);
        request.set_timeout(Duration::from_millis(1500));
        let t = timeout_of(request.metadata()).unwrap();
        assert!(
            t >= Duration::from_millis(1499) && t <= Duration::from_millis(1500),
            "{t:?}"
        );
        for bad in ["", "S", "123456789S", "12x", "-1S"] {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("grpc-timeout", bad.parse().unwrap());
            assert_eq!(timeout_of(&m), None, "{bad:?}");
        }
    }

    #[test]
    fn refusals_keep_their_class_across_a_status() {
        let errors = [
            WorkerError::InvalidRequest("a".into()),
            WorkerError::Overloaded("b".into()),
            WorkerError::Unavailable("c".into()),
        ];
        for e in errors {
            assert_eq!(worker_error_from_status(&e.clone().into()), e);
        }
        let down = tonic::Status::unavailable("connection refused");
        assert!(matches!(
            worker_error_from_status(&down),
            WorkerError::Unavailable(_)
        ));
        // A connection cut under the call: the router tries another node.
        let cut = tonic::Status::unknown("transport error");
        assert!(matches!(
            worker_error_from_status(&cut),
            WorkerError::Unavailable(_)
        ));
        let internal = tonic::Status::internal("engine failed");
        assert!(matches!(
            worker_error_from_status(&internal),
            WorkerError::Internal(_)
        ));
    }

    #[test]
    fn worker_roles_round_trip_and_others_are_refused() {
        use crate::protocol::NodeRole;
        for role in [NodeRole::Prefill, NodeRole::Decode] {
            let wire = node_role_to_pb(role) as i32;
            assert_eq!(node_role_from_pb("SwitchRoleRequest", wire), Ok(role));
        }
        assert_eq!(node_role_to_pb(NodeRole::Router), pb::NodeRole::Unspecified);
        for bad in [pb::NodeRole::Unspecified as i32, 7, -1] {
            let e = node_role_from_pb("SwitchRoleRequest", bad).unwrap_err();
            assert!(e.to_string().contains("neither prefill"), "{e}");
        }
    }
}
