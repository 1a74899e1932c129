//! A prefill worker as a decode worker sees it: in this process ([`PrefillHandle`]) or on
//! another node ([`crate::RemotePrefill`]). Both answer through the same reply channel.

use crate::request::{PrefillError, PrefillReply, PrefillRequest};
use crate::worker::PrefillHandle;
use crossbeam_channel::Sender;
use kvmesh_common::NodeId;
use kvmesh_engine::runner::KvShape;
use std::sync::Arc;

pub trait PrefillClient: Send + Sync + std::fmt::Debug {
    fn node_id(&self) -> NodeId;

    /// The KV the worker produces: a destination must use the same block size and layout.
    fn kv_shape(&self) -> KvShape;

    /// Queues `request`; its reply arrives on `reply` (exactly one, also when the worker stops
    /// or the connection fails). Never blocks. An error here means no reply will come.
    fn prefill(
        &self,
        request: PrefillRequest,
        reply: Sender<PrefillReply>,
    ) -> Result<(), PrefillError>;
}

/// How decode workers hold a prefill worker.
pub type PrefillTarget = Arc<dyn PrefillClient>;

impl PrefillClient for PrefillHandle {
    fn node_id(&self) -> NodeId {
        PrefillHandle::node_id(self)
    }

    fn kv_shape(&self) -> KvShape {
        PrefillHandle::kv_shape(self)
    }

    fn prefill(
        &self,
        request: PrefillRequest,
        reply: Sender<PrefillReply>,
    ) -> Result<(), PrefillError> {
        PrefillHandle::prefill(self, request, reply)
    }
}

impl From<PrefillHandle> for PrefillTarget {
    fn from(h: PrefillHandle) -> Self {
        Arc::new(h)
    }
}
