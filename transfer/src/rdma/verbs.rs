//! The RDMA transport on libibverbs (see the module docs one level up for the protocol): a
//! thin driver over the peer table (`peer_table.rs`), which holds every decision. This file
//! opens the device, allocates and connects queue pairs and rings, copies messages into the
//! staging buffer, posts what the table says to post, polls completions and tells the
//! table, decodes what landed, and frees what the table gives back.
//!
//! Raw verbs (ibverbs-sys) because ibverbs' safe API cannot post RDMA writes. The device's
//! handles live in `Device`, each link's in `LinkResources` (destroyed when the table lets
//! go of it: its queue pair, then its memory); `Shared` drops its table before the device,
//! after the completion poller thread has stopped.

use super::peer_table::{
    Action, Event, Landing, LinkKey, PeerTable, TableConfig, WriteGrant, WriteRefusal,
};
use super::{
    RdmaConfig, RdmaEndpoint, RdmaError, RdmaPeerInfo, RdmaRegion, RdmaSendError, Undelivered,
};
use crate::chunk::KvChunk;
use crate::codec::{CodecLimits, FrameDecoder, FrameEncoder};
use crate::transport::{KvReceiver, Transport, TransportError};
use crossbeam_channel::{Sender, TrySendError};
use ibverbs_sys as ffi;
use kvmesh_common::NodeId;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Send work requests per queue pair: the write and the credits (the table keeps within it).
const SEND_DEPTH: u32 = 32;
/// Receives kept posted per queue pair (each takes one incoming message or credit); at
/// least a peer's `SEND_DEPTH`, so a peer never has more in flight than there are receives.
const RECV_DEPTH: u32 = 64;
/// How long a prepared link waits for its peer's details (the exchange's RPC).
const EXCHANGE_LEASE: Duration = Duration::from_secs(30);
/// An idle link sends an empty credit this often, so that a vanished peer fails it.
const KEEPALIVE: Duration = Duration::from_secs(5);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the poller runs the table's clock.
const TIMER_EVERY: Duration = Duration::from_millis(10);

/// Room for every work request of every link: two per peer while it exchanges again, and as
/// many draining.
fn cq_depth(max_peers: usize) -> i32 {
    let per_link = (SEND_DEPTH + RECV_DEPTH + 1) as usize;
    (4 * max_peers.max(1) * per_link).min(i32::MAX as usize) as i32
}

fn verbs_err(op: &'static str) -> RdmaError {
    RdmaError::Verbs {
        op,
        source: io::Error::last_os_error(),
    }
}

fn errno_err(op: &'static str, errno: i32) -> RdmaError {
    RdmaError::Verbs {
        op,
        source: io::Error::from_raw_os_error(errno),
    }
}

/// Context, protection domain and the one completion queue every queue pair shares.
struct Device {
    name: String,
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    cq: *mut ffi::ibv_cq,
    port: u8,
    lid: u16,
    active_mtu: ffi::ibv_mtu,
    gid_index: Option<u8>,
    gid: [u8; 16],
}

impl Device {
    fn open(config: &RdmaConfig) -> Result<Device, RdmaError> {
        // Listing through ibverbs first gives the clear "no device" answer.
        let names: Vec<String> = match ibverbs::devices() {
            Ok(list) => list
                .iter()
                .filter_map(|d| d.name().map(|n| n.to_string_lossy().into_owned()))
                .collect(),
            Err(e) => return Err(RdmaError::NoDevice(e.to_string())),
        };
        if names.is_empty() {
            return Err(RdmaError::NoDevice("the device list is empty".into()));
        }
        let wanted = config.device.clone().unwrap_or_else(|| names[0].clone());
        let mut n = 0i32;
        // SAFETY: plain libibverbs calls; the list is freed below, after the device is open
        // (an open context keeps its device alive).
        unsafe {
            let list = ffi::ibv_get_device_list(&mut n);
            if list.is_null() {
                return Err(RdmaError::NoDevice(io::Error::last_os_error().to_string()));
            }
            let mut found = ptr::null_mut();
            for i in 0..n.max(0) as usize {
                let dev = *list.add(i);
                let name = std::ffi::CStr::from_ptr(ffi::ibv_get_device_name(dev));
                if name.to_string_lossy() == wanted {
                    found = dev;
                }
            }
            let ctx = if found.is_null() {
                ptr::null_mut()
            } else {
                ffi::ibv_open_device(found)
            };
            ffi::ibv_free_device_list(list);
            if found.is_null() {
                return Err(RdmaError::NoDevice(format!(
                    "no device named {wanted} (have {names:?})"
                )));
            }
            if ctx.is_null() {
                return Err(verbs_err("ibv_open_device"));
            }
            let mut dev = Device {
                name: wanted,
                ctx,
                pd: ptr::null_mut(),
                cq: ptr::null_mut(),
                port: config.port,
                lid: 0,
                active_mtu: ffi::IBV_MTU_1024,
                gid_index: config.gid_index,
                gid: [0; 16],
            };
            let mut port_attr: ffi::ibv_port_attr = std::mem::zeroed();
            let errno = ffi::ibv_query_port(ctx, dev.port, &mut port_attr as *mut _ as *mut _);
            if errno != 0 {
                return Err(errno_err("ibv_query_port", errno));
            }
            dev.lid = port_attr.lid;
            dev.active_mtu = port_attr.active_mtu;
            if let Some(index) = dev.gid_index {
                let mut gid: ffi::ibv_gid = std::mem::zeroed();
                let errno = ffi::ibv_query_gid(ctx, dev.port, index.into(), &mut gid);
                if errno != 0 {
                    return Err(errno_err("ibv_query_gid", errno));
                }
                dev.gid = gid.raw;
            }
            dev.pd = ffi::ibv_alloc_pd(ctx);
            if dev.pd.is_null() {
                return Err(verbs_err("ibv_alloc_pd"));
            }
            dev.cq = ffi::ibv_create_cq(
                ctx,
                cq_depth(config.max_peers),
                ptr::null_mut(),
                ptr::null_mut(),
                0,
            );
            if dev.cq.is_null() {
                return Err(verbs_err("ibv_create_cq"));
            }
            Ok(dev)
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: created in `open`; every queue pair and region on them is gone by now
        // (`Shared` drops its table first).
        unsafe {
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// Page-aligned memory registered with the device. Accessed through raw pointers only: the
/// NIC reads and writes it behind Rust's back.
struct Region {
    mr: *mut ffi::ibv_mr,
    ptr: *mut u8,
    len: usize,
}

impl Region {
    fn new(pd: *mut ffi::ibv_pd, len: usize, remote_write: bool) -> Result<Region, RdmaError> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| RdmaError::Config(e.to_string()))?;
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: a fresh allocation of `layout`, registered for exactly its length.
        unsafe {
            let ptr = std::alloc::alloc_zeroed(layout);
            if ptr.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            let mr = ffi::ibv_reg_mr(pd, ptr.cast(), len, access.0 as i32);
            if mr.is_null() {
                let e = verbs_err("ibv_reg_mr");
                std::alloc::dealloc(ptr, layout);
                return Err(e);
            }
            Ok(Region { mr, ptr, len })
        }
    }

    fn lkey(&self) -> u32 {
        // SAFETY: `mr` is valid while `self` lives.
        unsafe { (*self.mr).lkey }
    }

    fn descriptor(&self) -> RdmaRegion {
        RdmaRegion {
            addr: self.ptr as u64,
            // SAFETY: as above.
            rkey: unsafe { (*self.mr).rkey },
            len: self.len as u64,
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered and allocated in `new` with this layout.
        unsafe {
            ffi::ibv_dereg_mr(self.mr);
            let layout = std::alloc::Layout::from_size_align_unchecked(self.len.max(1), 4096);
            std::alloc::dealloc(self.ptr, layout);
        }
    }
}

/// One link's verbs resources: its queue pair, the ring the peer writes into, and the
/// staging buffer this side writes from.
struct LinkResources {
    qp: *mut ffi::ibv_qp,
    ring: Region,
    staging: Region,
}

impl LinkResources {
    fn new(dev: &Device, ring_bytes: usize) -> Result<LinkResources, RdmaError> {
        let ring = Region::new(dev.pd, ring_bytes, true)?;
        let staging = Region::new(dev.pd, ring_bytes, false)?;
        // SAFETY: plain verbs calls on live handles.
        let qp = unsafe {
            let mut attr: ffi::ibv_qp_init_attr = std::mem::zeroed();
            attr.send_cq = dev.cq;
            attr.recv_cq = dev.cq;
            attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
            attr.cap.max_send_wr = SEND_DEPTH;
            attr.cap.max_recv_wr = RECV_DEPTH + 1; // and the drain receive
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            ffi::ibv_create_qp(dev.pd, &mut attr)
        };
        if qp.is_null() {
            return Err(verbs_err("ibv_create_qp"));
        }
        Ok(LinkResources { qp, ring, staging })
    }

    fn info(&self, dev: &Device, psn: u32) -> RdmaPeerInfo {
        RdmaPeerInfo {
            endpoint: RdmaEndpoint {
                // SAFETY: the queue pair lives as long as `self`.
                qp_num: unsafe { (*self.qp).qp_num },
                lid: dev.lid,
                gid: dev.gid,
                psn,
            },
            region: self.ring.descriptor(),
        }
    }

    /// INIT -> RTR (towards `remote`) -> RTS, sending from packet number `psn`.
    fn connect(&self, dev: &Device, remote: RdmaEndpoint, psn: u32) -> Result<(), RdmaError> {
        // SAFETY: state transitions of a live queue pair.
        unsafe {
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
            a.pkey_index = 0;
            a.port_num = dev.port;
            a.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE)
                .0;
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ffi::ibv_qp_attr_mask::IBV_QP_PORT
                | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
            let errno = ffi::ibv_modify_qp(self.qp, &mut a, mask.0 as i32);
            if errno != 0 {
                return Err(errno_err("ibv_modify_qp(INIT)", errno));
            }

            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = dev.active_mtu;
            a.dest_qp_num = remote.qp_num;
            a.rq_psn = remote.psn;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = 12;
            a.ah_attr.dlid = remote.lid;
            a.ah_attr.port_num = dev.port;
            if let Some(index) = dev.gid_index {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = remote.gid;
                a.ah_attr.grh.sgid_index = index;
                a.ah_attr.grh.hop_limit = 64;
            }
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_AV
                | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            let errno = ffi::ibv_modify_qp(self.qp, &mut a, mask.0 as i32);
            if errno != 0 {
                return Err(errno_err("ibv_modify_qp(RTR)", errno));
            }

            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
            a.sq_psn = psn;
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7; // retry forever while the peer has no receive posted
            a.max_rd_atomic = 1;
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            let errno = ffi::ibv_modify_qp(self.qp, &mut a, mask.0 as i32);
            if errno != 0 {
                return Err(errno_err("ibv_modify_qp(RTS)", errno));
            }
        }
        Ok(())
    }

    /// Posts one receive (no scatter entries: RDMA-write immediates and zero-length sends
    /// need none).
    fn post_recv(&self, wr_id: u64) -> Result<(), RdmaError> {
        // SAFETY: a live queue pair; the work request is valid for the call.
        let errno = unsafe {
            let mut wr: ffi::ibv_recv_wr = std::mem::zeroed();
            wr.wr_id = wr_id;
            let mut bad = ptr::null_mut();
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_recv {
                Some(f) => f(self.qp, &mut wr, &mut bad),
                None => ENOSYS,
            }
        };
        if errno != 0 {
            return Err(errno_err("ibv_post_recv", errno));
        }
        Ok(())
    }

    /// Hands `bytes` of the ring back to the peer with a zero-length SEND_WITH_IMM.
    fn post_credit(&self, wr_id: u64, bytes: u32) -> Result<(), RdmaError> {
        // SAFETY: a live queue pair; the work request is valid for the call.
        let errno = unsafe {
            let mut wr: ffi::ibv_send_wr = std::mem::zeroed();
            wr.wr_id = wr_id;
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.__bindgen_anon_1.imm_data = bytes.to_be();
            post_send(self.qp, &mut wr)
        };
        if errno != 0 {
            return Err(errno_err("ibv_post_send(credit)", errno));
        }
        Ok(())
    }

    /// Writes the first `len` staged bytes into the peer's ring where `grant` says.
    fn post_write(&self, grant: &WriteGrant<Arc<LinkResources>>, len: u32, wr_id: u64) -> i32 {
        let mut sge = ffi::ibv_sge {
            addr: self.staging.ptr as u64,
            length: len,
            lkey: self.staging.lkey(),
        };
        // SAFETY: the work request and scatter entry outlive the call; the staging buffer
        // stays untouched until the write's completion (the table grants no other write).
        unsafe {
            let mut wr: ffi::ibv_send_wr = std::mem::zeroed();
            wr.wr_id = wr_id;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.__bindgen_anon_1.imm_data = len.to_be();
            wr.wr.rdma.remote_addr = grant.remote_addr;
            wr.wr.rdma.rkey = grant.rkey;
            post_send(self.qp, &mut wr)
        }
    }

    /// Moves the queue pair to the error state (its work flushes) and posts the drain
    /// receive, whose flushed completion comes after every earlier receive's.
    fn drain(&self, wr_id: u64) -> Result<(), RdmaError> {
        // SAFETY: a state transition of a live queue pair.
        let errno = unsafe {
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE;
            ffi::ibv_modify_qp(self.qp, &mut a, mask.0 as i32)
        };
        if errno != 0 {
            return Err(errno_err("ibv_modify_qp(ERR)", errno));
        }
        self.post_recv(wr_id)
    }
}

impl Drop for LinkResources {
    fn drop(&mut self) {
        // SAFETY: created in `new`; the table let go of it and no call holds it. The
        // regions are deregistered after (field drops follow this).
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
        }
    }
}

/// A chunk decoded from a ring, waiting for room in its node's queue; its ring space goes
/// back once it is queued.
struct Waiting {
    key: LinkKey,
    dest: NodeId,
    chunk: KvChunk,
    advance: u64,
}

type Table = PeerTable<Arc<LinkResources>, KvChunk>;

struct Shared {
    // Field order is drop order: the links (queue pairs, regions) before the device.
    table: Mutex<Table>,
    /// Signalled when the table changed (a write completed, a credit came in, a link went).
    changed: Condvar,
    /// Decoded chunks, in the order they landed.
    waiting: Mutex<VecDeque<Waiting>>,
    device: Device,
    nodes: RwLock<HashMap<NodeId, Sender<KvChunk>>>,
    config: RdmaConfig,
    /// Polling the completion queue failed: every link was given up, no new ones.
    cq_failed: AtomicBool,
    stop: AtomicBool,
}

// SAFETY: verbs handles may be used from any thread (libibverbs locks internally); the
// registered memory is only touched under the protocol's ownership rules: the staging buffer
// while the table grants its write, a ring slice between its landing and its credit.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}
unsafe impl Send for LinkResources {}
unsafe impl Sync for LinkResources {}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the table, carries out the actions it left (posts under the lock, so
    /// nothing is posted on a link the table has let go of), frees what it let go of after
    /// the lock, and wakes the waiters.
    fn with_table<T>(&self, f: impl FnOnce(&mut Table) -> T) -> T {
        let mut table = self.lock();
        let out = f(&mut table);
        let freed = carry_out(&mut table);
        drop(table);
        self.changed.notify_all();
        drop(freed);
        out
    }
}

/// Carries out `table`'s actions; the resources it freed, to drop after the lock.
fn carry_out(table: &mut Table) -> Vec<Arc<LinkResources>> {
    let mut freed = Vec::new();
    while let Some(action) = table.poll_action() {
        let (key, result) = match action {
            Action::PostRecv {
                key,
                resources,
                wr_id,
            } => (key, resources.post_recv(wr_id)),
            Action::PostCredit {
                key,
                resources,
                wr_id,
                bytes,
            } => (key, resources.post_credit(wr_id, bytes)),
            Action::Drain { resources, wr_id } => {
                // Without its drain completion the link goes at the drain timeout.
                if let Err(e) = resources.drain(wr_id) {
                    tracing::warn!(error = %e, "cannot drain a failed RDMA link");
                }
                continue;
            }
            Action::Free { node, resources } => {
                tracing::debug!(%node, "RDMA link freed");
                freed.push(resources);
                continue;
            }
        };
        if let Err(e) = result {
            table.post_failed(key, &e.to_string(), Instant::now());
        }
    }
    freed
}

/// See the module docs.
pub struct RdmaTransport {
    shared: Arc<Shared>,
    poller: Option<JoinHandle<()>>,
}

impl RdmaTransport {
    /// Opens the device (`NoDevice` where there is none) and starts the completion poller.
    pub fn open(config: RdmaConfig) -> Result<RdmaTransport, RdmaError> {
        if config.ring_bytes < 1 << 20 || config.ring_bytes as u64 > u64::from(u32::MAX) {
            // Message lengths and credits travel as 32-bit immediates.
            return Err(RdmaError::Config(
                "ring_bytes must be at least 1 MiB and below 4 GiB".into(),
            ));
        }
        if config.max_peers == 0 {
            return Err(RdmaError::Config("max_peers must be at least 1".into()));
        }
        let device = Device::open(&config)?;
        let table = Table::new(TableConfig {
            ring_bytes: config.ring_bytes as u64,
            send_depth: SEND_DEPTH,
            recv_depth: RECV_DEPTH,
            max_peers: config.max_peers,
            exchange_lease: EXCHANGE_LEASE,
            keepalive: KEEPALIVE,
            drain_timeout: DRAIN_TIMEOUT,
        });
        let shared = Arc::new(Shared {
            table: Mutex::new(table),
            changed: Condvar::new(),
            waiting: Mutex::default(),
            device,
            nodes: RwLock::default(),
            config,
            cq_failed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let poller = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("kvmesh-rdma".into())
                .spawn(move || poll_loop(&shared))
                .map_err(|source| RdmaError::Verbs {
                    op: "spawn poller",
                    source,
                })?
        };
        Ok(RdmaTransport {
            shared,
            poller: Some(poller),
        })
    }

    pub fn device_name(&self) -> &str {
        &self.shared.device.name
    }

    /// Creates a queue pair and receive ring for `peer`; send the result to the peer. Once
    /// connected they replace (and free) the peer's earlier ones.
    pub fn prepare_peer(&self, peer: NodeId) -> Result<RdmaPeerInfo, RdmaError> {
        let s = &self.shared;
        if s.cq_failed.load(Ordering::Relaxed) {
            return Err(RdmaError::Verbs {
                op: "ibv_poll_cq",
                source: io::Error::other("the completion queue failed; RDMA is off"),
            });
        }
        let key = s.with_table(|t| t.begin_prepare(peer, Instant::now()))?;
        let resources = match LinkResources::new(&s.device, s.config.ring_bytes) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                s.with_table(|t| t.abandon(key, &e.to_string(), Instant::now()));
                return Err(e);
            }
        };
        let info = resources.info(&s.device, key.psn());
        s.with_table(|t| t.finish_prepare(key, resources, Instant::now()))
            .map_err(|_| RdmaError::NotPrepared(peer))?;
        Ok(info)
    }

    /// Connects the queue pair prepared for `peer` to the peer's, and posts its receives.
    pub fn connect_peer(&self, peer: NodeId, remote: RdmaPeerInfo) -> Result<(), RdmaError> {
        let s = &self.shared;
        let (key, resources) = s.with_table(|t| t.begin_connect(peer, Instant::now()))?;
        match resources.connect(&s.device, remote.endpoint, key.psn()) {
            Ok(()) => s.with_table(|t| t.finish_connect(peer, key, remote.region, Instant::now())),
            Err(e) => {
                s.with_table(|t| t.connect_failed(key, &e.to_string(), Instant::now()));
                Err(e)
            }
        }
    }

    pub fn link_up(&self, peer: NodeId) -> bool {
        self.shared.lock().link_up(peer)
    }

    /// Waits for the staging buffer and for room in the peer's ring, copies the encoded
    /// chunk into the staging buffer and posts the write; returns once it is posted. A
    /// chunk that cannot go over RDMA waits with the peer's undelivered ones.
    pub fn try_send(
        &self,
        dest: NodeId,
        chunk: KvChunk,
        deadline: Instant,
    ) -> Result<(), RdmaSendError> {
        let s = &self.shared;
        let mut head = Vec::new();
        FrameEncoder::with_limits(dest, chunk.header.request_id, s.config.limits)
            .encode_head(&chunk, &mut head)
            .map_err(|e| RdmaSendError::Dropped(TransportError::Invalid(e)))?;
        let len = (head.len() + chunk.payload.len()) as u64;
        let mut table = s.lock();
        let grant = loop {
            match table.begin_write(dest, len) {
                Ok(grant) => break grant,
                Err(WriteRefusal::Busy) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(RdmaSendError::Dropped(TransportError::Timeout(dest)));
                    }
                    table = s
                        .changed
                        .wait_timeout(table, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                Err(refusal) => {
                    table.park(dest, Undelivered { chunk, deadline });
                    return Err(match refusal {
                        WriteRefusal::TooLarge { len, max } => RdmaSendError::TooLarge { len, max },
                        WriteRefusal::NoLink(why) => RdmaSendError::Unusable(why),
                        WriteRefusal::Busy => unreachable!("handled above"),
                    });
                }
            }
        };
        drop(table);
        let staging = &grant.resources.staging;
        // SAFETY: the table granted this link's staging buffer to this write alone (until
        // it is committed and completes); `len` fits it (no more than the ring's bytes).
        unsafe {
            ptr::copy_nonoverlapping(head.as_ptr(), staging.ptr, head.len());
            ptr::copy_nonoverlapping(
                chunk.payload.as_ptr(),
                staging.ptr.add(head.len()),
                chunk.payload.len(),
            );
        }
        s.with_table(|t| {
            let now = Instant::now();
            let wr_id = t
                .commit_write(dest, grant.key, len, Undelivered { chunk, deadline }, now)
                .map_err(RdmaSendError::Unusable)?;
            match grant.resources.post_write(&grant, len as u32, wr_id) {
                0 => Ok(()),
                errno => {
                    let why = io::Error::from_raw_os_error(errno).to_string();
                    t.post_failed(grant.key, &format!("posting a write: {why}"), now);
                    Err(RdmaSendError::Unusable(why))
                }
            }
        })
    }

    /// Waits until the write in flight to `dest` completes, giving its link up at the
    /// write's deadline.
    pub fn settle(&self, dest: NodeId) {
        let s = &self.shared;
        let mut table = s.lock();
        while let Some(deadline) = table.in_flight(dest) {
            let now = Instant::now();
            if now >= deadline {
                drop(table);
                s.with_table(|t| t.give_up(dest, "a write did not complete by its deadline", now));
                return;
            }
            table = s
                .changed
                .wait_timeout(table, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub fn take_undelivered(&self, dest: NodeId) -> Vec<Undelivered> {
        self.shared.lock().take_undelivered(dest)
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(poller) = self.poller.take() {
            let _ = poller.join();
        }
    }
}

impl Transport for RdmaTransport {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        let mut nodes = self.shared.nodes.write().unwrap_or_else(|e| e.into_inner());
        if nodes.contains_key(&node) {
            return Err(TransportError::AlreadyBound(node));
        }
        let (tx, rx) = crossbeam_channel::bounded(self.shared.config.queue_chunks.max(1));
        nodes.insert(node, tx);
        Ok(rx)
    }

    fn unbind(&self, node: NodeId) {
        let mut nodes = self.shared.nodes.write().unwrap_or_else(|e| e.into_inner());
        nodes.remove(&node);
    }

    /// [`RdmaTransport::try_send`] on its own: what cannot go over RDMA is dropped.
    fn send(&self, dest: NodeId, chunk: KvChunk, deadline: Instant) -> Result<(), TransportError> {
        self.try_send(dest, chunk, deadline).map_err(|e| match e {
            RdmaSendError::Dropped(e) => e,
            e => {
                self.take_undelivered(dest);
                TransportError::Connection {
                    node: dest,
                    reason: e.to_string(),
                }
            }
        })
    }
}

/// SAFETY: `qp` is live and `wr` valid for the call.
unsafe fn post_send(qp: *mut ffi::ibv_qp, wr: &mut ffi::ibv_send_wr) -> i32 {
    let mut bad = ptr::null_mut();
    // SAFETY: per the function's contract; ops are filled in by the provider.
    unsafe {
        let ctx = (*qp).context;
        match (*ctx).ops.post_send {
            Some(f) => f(qp, wr, &mut bad),
            None => ENOSYS,
        }
    }
}

const ENOSYS: i32 = 38;

/// What a work completion reports, for the table.
fn event(wc: &ffi::ibv_wc) -> Event {
    if let Some((status, vendor)) = wc.error() {
        return Event::Failed(format!("work completion status {status} (vendor {vendor})"));
    }
    let imm = wc.imm_data().map(u32::from_be);
    match (wc.opcode(), imm) {
        (ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM, Some(len)) => Event::Landed(len),
        (ffi::ibv_wc_opcode::IBV_WC_RECV, Some(bytes)) => Event::Credited(bytes),
        (ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM | ffi::ibv_wc_opcode::IBV_WC_RECV, None) => {
            Event::Failed("a message without its immediate".into())
        }
        _ => Event::Done,
    }
}

/// The completion poller: completions to the table, landed messages decoded and queued,
/// the table's clock. Spins briefly when idle, then naps, so an idle transport costs little
/// CPU.
fn poll_loop(s: &Shared) {
    // SAFETY: ibv_wc is plain data.
    let mut wcs: Vec<ffi::ibv_wc> = vec![unsafe { std::mem::zeroed() }; 32];
    let mut idle = 0u32;
    let mut last_timer = Instant::now();
    while !s.stop.load(Ordering::Relaxed) {
        let mut busy = deliver_waiting(s);
        let n = if s.cq_failed.load(Ordering::Relaxed) {
            0
        } else {
            // SAFETY: the completion queue is live until `Shared` drops, after this thread.
            unsafe {
                let ctx = (*s.device.cq).context;
                match (*ctx).ops.poll_cq {
                    Some(f) => f(s.device.cq, wcs.len() as i32, wcs.as_mut_ptr()),
                    None => -1,
                }
            }
        };
        if n < 0 {
            tracing::error!(device = %s.device.name, "ibv_poll_cq failed; RDMA is off, KV goes over QUIC");
            s.cq_failed.store(true, Ordering::Relaxed);
            s.with_table(|t| t.give_up_all("the completion queue failed", Instant::now()));
        }
        if n > 0 {
            let landings: Vec<Landing<Arc<LinkResources>>> = s.with_table(|t| {
                let now = Instant::now();
                wcs[..n as usize]
                    .iter()
                    .filter_map(|wc| t.on_completion(wc.wr_id(), event(wc), now))
                    .collect()
            });
            for landing in landings {
                landed(s, landing);
            }
            busy = true;
        }
        let now = Instant::now();
        if now.duration_since(last_timer) >= TIMER_EVERY {
            last_timer = now;
            s.with_table(|t| t.on_timer(now));
        }
        if busy {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle > 1000 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// A message landed: decode it and queue its chunk (or keep it waiting); a malformed one
/// is dropped and its space handed back at once.
fn landed(s: &Shared, l: Landing<Arc<LinkResources>>) {
    // SAFETY: the peer wrote these bytes before the completion that brought us here, and
    // will not write them again until we hand the space back; the table placed them inside
    // the ring, and `l.resources` keeps it registered.
    let bytes = unsafe {
        std::slice::from_raw_parts(l.resources.ring.ptr.add(l.offset as usize), l.len as usize)
    };
    match decode_one(bytes, s.config.limits) {
        Ok((dest, chunk)) => {
            s.waiting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back(Waiting {
                    key: l.key,
                    dest,
                    chunk,
                    advance: l.advance,
                });
            deliver_waiting(s);
        }
        Err(e) => {
            tracing::warn!(error = %e, "malformed RDMA KV message; dropped");
            s.with_table(|t| t.consumed(l.key, l.advance, Instant::now()));
        }
    }
}

fn decode_one(bytes: &[u8], limits: CodecLimits) -> Result<(NodeId, KvChunk), String> {
    let mut decoder = FrameDecoder::new(limits);
    decoder.push(bytes);
    let chunk = decoder
        .next_chunk()
        .map_err(|e| e.to_string())?
        .ok_or("a truncated message")?;
    decoder.finish().map_err(|e| e.to_string())?;
    let dest = decoder.preamble().ok_or("no preamble")?.dest;
    Ok((dest, chunk))
}

/// Queues waiting chunks in order while their nodes' queues have room, and hands their
/// ring space back; true if any moved.
fn deliver_waiting(s: &Shared) -> bool {
    let mut waiting = s.waiting.lock().unwrap_or_else(|e| e.into_inner());
    let mut consumed = Vec::new();
    while let Some(w) = waiting.pop_front() {
        let queue = s
            .nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&w.dest)
            .cloned();
        match queue.map(|q| q.try_send(w.chunk)) {
            Some(Err(TrySendError::Full(chunk))) => {
                waiting.push_front(Waiting { chunk, ..w });
                break;
            }
            Some(Ok(())) => {}
            // A one-sided write cannot be refused; the decode side times out and recomputes.
            None | Some(Err(TrySendError::Disconnected(_))) => {
                tracing::warn!(node = %w.dest, "RDMA KV chunk for a node not bound here; dropped");
            }
        }
        consumed.push((w.key, w.advance));
    }
    drop(waiting);
    if consumed.is_empty() {
        return false;
    }
    s.with_table(|t| {
        let now = Instant::now();
        for (key, advance) in consumed {
            t.consumed(key, advance, now);
        }
    });
    true
}
