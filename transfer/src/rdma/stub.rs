//! Stands in for the RDMA transport when the `rdma` feature is off, so call sites carry no
//! `#[cfg]`: it cannot be opened, hence none of its methods can ever run.

use super::{RdmaConfig, RdmaError, RdmaPeerInfo, RdmaSendError, Undelivered};
use crate::chunk::KvChunk;
use crate::transport::{KvReceiver, Transport, TransportError};
use kvmesh_common::{NodeId, RequestId};
use std::convert::Infallible;
use std::time::Instant;

pub struct RdmaTransport {
    never: Infallible,
}

impl RdmaTransport {
    pub fn open(config: RdmaConfig) -> Result<RdmaTransport, RdmaError> {
        let _ = config;
        Err(RdmaError::NotCompiled)
    }

    pub fn device_name(&self) -> &str {
        match self.never {}
    }

    pub fn prepare_peer(&self, _peer: NodeId) -> Result<RdmaPeerInfo, RdmaError> {
        match self.never {}
    }

    pub fn connect_peer(&self, _peer: NodeId, _remote: RdmaPeerInfo) -> Result<(), RdmaError> {
        match self.never {}
    }

    pub fn link_up(&self, _peer: NodeId) -> bool {
        match self.never {}
    }

    pub fn try_send(
        &self,
        _dest: NodeId,
        _chunk: KvChunk,
        _deadline: Instant,
    ) -> Result<(), RdmaSendError> {
        match self.never {}
    }

    pub fn settle(&self, _dest: NodeId) {
        match self.never {}
    }

    pub fn take_undelivered(&self, _dest: NodeId) -> Vec<Undelivered> {
        match self.never {}
    }
}

impl Transport for RdmaTransport {
    fn bind(&self, _node: NodeId) -> Result<KvReceiver, TransportError> {
        match self.never {}
    }

    fn unbind(&self, _node: NodeId) {
        match self.never {}
    }

    fn send(
        &self,
        _dest: NodeId,
        _chunk: KvChunk,
        _deadline: Instant,
    ) -> Result<(), TransportError> {
        match self.never {}
    }

    fn end_transfer(&self, _dest: NodeId, _request: RequestId) {
        match self.never {}
    }
}
