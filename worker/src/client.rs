//! A prefill worker as a decode worker sees it: in this process (the prefill crate's
//! `PrefillHandle`) or on another node ([`crate::RemotePrefill`]). Both answer through the
//! same reply channel.

use crate::request::{PrefillError, PrefillReply, PrefillRequest};
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
