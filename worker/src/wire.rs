//! The prefill messages on the wire (`kvmesh.v1.Prefill`) and back.

use crate::request::{CancelToken, KvDestination, PrefillDone, PrefillError, PrefillRequest};
use kvmesh_common::grpc::{logprobs_from_pb, logprobs_to_pb, params_from, pb, WireError};
use kvmesh_common::{BlockId, NodeId, RequestId};
use kvmesh_engine::runner::KvShape;
use kvmesh_engine::sampler::Sampled;
use kvmesh_transfer::{RdmaEndpoint, RdmaPeerInfo, RdmaRegion};
use tonic::{Code, Status};

/// Where a prefill request's destination can be reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DestinationAddresses {
    /// Where it receives KV.
    pub transfer: String,
    /// Where it serves `KvCache.Export` (empty: the prefill node does not pull from it).
    pub holder: String,
}

impl DestinationAddresses {
    /// Receives KV at `transfer`; serves no pulls.
    pub fn receive_only(transfer: String) -> Self {
        DestinationAddresses {
            transfer,
            holder: String::new(),
        }
    }
}

/// The request as sent: `holder` is sent only when the request names a holder.
pub fn request_to_pb(r: &PrefillRequest, to: &DestinationAddresses) -> pb::PrefillRequest {
    let holder = if r.holder.is_some() {
        &to.holder[..]
    } else {
        ""
    };
    pb::PrefillRequest {
        request_id: r.request_id.0,
        prompt: r.prompt.clone(),
        params: Some((&r.params).into()),
        cached_prefix_len: r.cached_prefix_len as u64,
        destination: Some(pb::KvDestination {
            node_id: r.destination.node.0,
            transfer_address: to.transfer.clone(),
            blocks: r.destination.blocks.iter().map(|b| b.0).collect(),
        }),
        holder_address: holder.to_string(),
    }
}

/// The request (with a fresh cancel token, and no holder: the caller connects to
/// `holder`'s address) and where its destination is.
pub fn request_from_pb(
    m: pb::PrefillRequest,
) -> Result<(PrefillRequest, DestinationAddresses), WireError> {
    const M: &str = "PrefillRequest";
    let params = params_from(M, m.params)?;
    let dest = m
        .destination
        .ok_or_else(|| WireError::missing(M, "destination"))?;
    let cached_prefix_len = usize::try_from(m.cached_prefix_len).map_err(|_| WireError {
        message: M,
        reason: format!("cached_prefix_len {} is out of range", m.cached_prefix_len),
    })?;
    let request = PrefillRequest {
        request_id: RequestId(m.request_id),
        prompt: m.prompt,
        params,
        cached_prefix_len,
        destination: KvDestination {
            node: NodeId(dest.node_id),
            blocks: dest.blocks.into_iter().map(BlockId).collect(),
        },
        holder: None,
        cancel: CancelToken::new(),
    };
    let to = DestinationAddresses {
        transfer: dest.transfer_address,
        holder: m.holder_address,
    };
    Ok((request, to))
}

pub fn done_to_pb(d: &PrefillDone) -> pb::PrefillReply {
    pb::PrefillReply {
        first: Some(pb::Sampled {
            token: d.first.token,
            logprob: d.first.logprob,
            top_logprobs: logprobs_to_pb(&d.first.top_logprobs),
        }),
        cached_tokens: d.cached_tokens as u64,
        chunks_sent: d.chunks_sent,
        bytes_sent: d.bytes_sent,
    }
}

pub fn done_from_pb(m: pb::PrefillReply) -> Result<PrefillDone, WireError> {
    let first = m
        .first
        .ok_or_else(|| WireError::missing("PrefillReply", "first"))?;
    Ok(PrefillDone {
        first: Sampled {
            token: first.token,
            logprob: first.logprob,
            top_logprobs: logprobs_from_pb(&first.top_logprobs),
        },
        cached_tokens: m.cached_tokens as usize,
        chunks_sent: m.chunks_sent,
        bytes_sent: m.bytes_sent,
    })
}

pub fn kv_shape_to_pb(s: &KvShape) -> pb::KvShape {
    pb::KvShape {
        num_layers: s.num_layers as u32,
        num_kv_heads: s.num_kv_heads as u32,
        head_dim: s.head_dim as u32,
        block_size: s.block_size as u32,
        num_blocks: s.num_blocks as u32,
    }
}

pub fn kv_shape_from_pb(s: &pb::KvShape) -> KvShape {
    KvShape {
        num_layers: s.num_layers as usize,
        num_kv_heads: s.num_kv_heads as usize,
        head_dim: s.head_dim as usize,
        block_size: s.block_size as usize,
        num_blocks: s.num_blocks as usize,
    }
}

impl From<PrefillError> for Status {
    fn from(e: PrefillError) -> Self {
        let code = match &e {
            PrefillError::InvalidRequest(_) => Code::InvalidArgument,
            PrefillError::Overloaded => Code::ResourceExhausted,
            PrefillError::Unavailable => Code::Unavailable,
            PrefillError::Cancelled => Code::Cancelled,
            PrefillError::Transfer(_) => Code::Aborted,
            PrefillError::Engine(_) | PrefillError::Rpc(_) => Code::Internal,
        };
        let message = match e {
            PrefillError::InvalidRequest(m) => m,
            other => other.to_string(),
        };
        Status::new(code, message)
    }
}

/// A failed `Prefill` call as the decode worker sees it (it prefills locally either way).
pub fn error_from_status(s: &Status) -> PrefillError {
    match s.code() {
        Code::InvalidArgument => PrefillError::InvalidRequest(s.message().to_string()),
        Code::ResourceExhausted => PrefillError::Overloaded,
        Code::Cancelled => PrefillError::Cancelled,
        _ => PrefillError::Rpc(format!("{:?}: {}", s.code(), s.message())),
    }
}

pub fn rdma_info_to_pb(i: &RdmaPeerInfo) -> pb::RdmaPeerInfo {
    pb::RdmaPeerInfo {
        qp_num: i.endpoint.qp_num,
        lid: i.endpoint.lid.into(),
        gid: i.endpoint.gid.to_vec(),
        psn: i.endpoint.psn,
        ring_addr: i.region.addr,
        ring_rkey: i.region.rkey,
        ring_len: i.region.len,
    }
}

/// `message` names the enclosing message in errors; a missing `info` is an error too.
pub fn rdma_info_from_pb(
    message: &'static str,
    m: Option<pb::RdmaPeerInfo>,
) -> Result<RdmaPeerInfo, WireError> {
    let m = m.ok_or_else(|| WireError::missing(message, "info"))?;
    let bad = |reason: String| WireError { message, reason };
    let lid = u16::try_from(m.lid).map_err(|_| bad(format!("lid {} is not 16-bit", m.lid)))?;
    let gid: [u8; 16] = m
        .gid
        .as_slice()
        .try_into()
        .map_err(|_| bad(format!("gid has {} bytes, not 16", m.gid.len())))?;
    if m.ring_len == 0 {
        return Err(bad("the receive ring is empty".into()));
    }
    Ok(RdmaPeerInfo {
        endpoint: RdmaEndpoint {
            qp_num: m.qp_num,
            lid,
            gid,
            psn: m.psn,
        },
        region: RdmaRegion {
            addr: m.ring_addr,
            rkey: m.ring_rkey,
            len: m.ring_len,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_common::SamplingParams;
    use std::sync::Arc;

    /// A holder, as far as the wire cares.
    #[derive(Debug)]
    struct NoExports;

    impl crate::KvExporter for NoExports {
        fn node_id(&self) -> NodeId {
            NodeId(0x200)
        }

        fn export(
            &self,
            _: crate::ExportRequest,
            _: crossbeam_channel::Sender<crate::ExportReply>,
        ) -> Result<(), crate::ExportError> {
            Err(crate::ExportError::Unavailable)
        }
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let r = PrefillRequest {
            request_id: RequestId(5),
            prompt: vec![1, 2, 3, 4],
            params: SamplingParams::greedy(3),
            cached_prefix_len: 16,
            destination: KvDestination {
                node: NodeId(0x200),
                blocks: vec![BlockId(9), BlockId(2)],
            },
            holder: None,
            cancel: CancelToken::new(),
        };
        let to = DestinationAddresses {
            transfer: "127.0.0.3:7000".into(),
            holder: "127.0.0.3:7001".into(),
        };
        let (back, addr) = request_from_pb(request_to_pb(&r, &to)).unwrap();
        // No holder named: the prefill node is not told where to pull from.
        assert_eq!(
            (&addr.transfer[..], &addr.holder[..]),
            ("127.0.0.3:7000", "")
        );
        let named = PrefillRequest {
            holder: Some(Arc::new(NoExports)),
            ..r.clone()
        };
        let (_, addr) = request_from_pb(request_to_pb(&named, &to)).unwrap();
        assert_eq!(addr, to);
        assert_eq!(
            (
                back.request_id,
                &back.prompt,
                &back.params,
                back.cached_prefix_len
            ),
            (r.request_id, &r.prompt, &r.params, r.cached_prefix_len)
        );
        assert_eq!(back.destination, r.destination);
        let done = PrefillDone {
            first: Sampled {
                token: 7,
                logprob: Some(-0.25),
                top_logprobs: vec![(7, -0.25)],
            },
            cached_tokens: 16,
            chunks_sent: 30,
            bytes_sent: 1 << 20,
        };
        assert_eq!(done_from_pb(done_to_pb(&done)).unwrap(), done);
        assert!(done_from_pb(pb::PrefillReply::default()).is_err());
        let no_dest = pb::PrefillRequest {
            destination: None,
            ..request_to_pb(&r, &to)
        };
        assert!(request_from_pb(no_dest).is_err());
    }

    #[test]
    fn errors_keep_their_class_across_a_status() {
        let invalid = PrefillError::InvalidRequest("too long".into());
        assert_eq!(error_from_status(&invalid.clone().into()), invalid);
        assert_eq!(
            error_from_status(&PrefillError::Overloaded.into()),
            PrefillError::Overloaded
        );
        assert!(matches!(
            error_from_status(&Status::unavailable("refused")),
            PrefillError::Rpc(_)
        ));
    }

    #[test]
    fn rdma_info_round_trips_and_bad_fields_are_refused() {
        let info = RdmaPeerInfo {
            endpoint: RdmaEndpoint {
                qp_num: 77,
                lid: 3,
                gid: [9; 16],
                psn: 0x12_3456,
            },
            region: RdmaRegion {
                addr: 0x7f00_0000_1000,
                rkey: 0xdead,
                len: 128 << 20,
            },
        };
        let m = rdma_info_to_pb(&info);
        assert_eq!(rdma_info_from_pb("T", Some(m.clone())).unwrap(), info);
        assert!(rdma_info_from_pb("T", None).is_err());
        let short_gid = pb::RdmaPeerInfo {
            gid: vec![1; 4],
            ..m.clone()
        };
        assert!(rdma_info_from_pb("T", Some(short_gid)).is_err());
        let big_lid = pb::RdmaPeerInfo {
            lid: 70_000,
            ..m.clone()
        };
        assert!(rdma_info_from_pb("T", Some(big_lid)).is_err());
        let no_ring = pb::RdmaPeerInfo { ring_len: 0, ..m };
        assert!(rdma_info_from_pb("T", Some(no_ring)).is_err());
    }
}
