//! The in-process transport: delivery order, backpressure, and unreachable nodes.

use kvmesh_common::{BlockId, NodeId, RequestId};
use kvmesh_transfer::{BlockShape, InProcessTransport, KvChunk, Transport, TransportError};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

fn shape() -> BlockShape {
    BlockShape {
        num_kv_heads: 1,
        block_size: 2,
        head_dim: 2,
    }
}

/// A one-layer, one-block chunk whose payload is `tag` repeated.
fn chunk(tag: u8) -> KvChunk {
    KvChunk::seal(RequestId(1), 0..1, vec![BlockId(0)], shape(), vec![tag; 16]).unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

#[test]
fn chunks_arrive_intact_and_in_order() {
    let t = InProcessTransport::new(8);
    let rx = t.bind(NodeId(2)).unwrap();
    for tag in 0..5 {
        t.send(NodeId(2), chunk(tag), soon()).unwrap();
    }
    for tag in 0..5 {
        let c = rx.try_recv().unwrap();
        c.verify().unwrap();
        assert_eq!(c.payload[0], tag);
    }
}

#[test]
fn a_full_queue_holds_the_sender_back_until_the_deadline() {
    let t = InProcessTransport::new(2);
    let _rx = t.bind(NodeId(2)).unwrap();
    t.send(NodeId(2), chunk(0), soon()).unwrap();
    t.send(NodeId(2), chunk(1), soon()).unwrap();
    let start = Instant::now();
    let deadline = start + Duration::from_millis(50);
    assert_eq!(
        t.send(NodeId(2), chunk(2), deadline),
        Err(TransportError::Timeout(NodeId(2)))
    );
    assert!(start.elapsed() >= Duration::from_millis(50));
}

#[test]
fn a_blocked_sender_resumes_when_the_receiver_drains() {
    let t = Arc::new(InProcessTransport::new(1));
    let rx = t.bind(NodeId(2)).unwrap();
    let sender = {
        let t = t.clone();
        thread::spawn(move || {
            for tag in 0..20 {
                t.send(NodeId(2), chunk(tag), soon()).unwrap();
            }
        })
    };
    let got: Vec<u8> = (0..20).map(|_| rx.recv().unwrap().payload[0]).collect();
    sender.join().unwrap();
    assert_eq!(got, (0..20).collect::<Vec<u8>>());
}

#[test]
fn unbound_and_dropped_receivers_are_unreachable() {
    let t = InProcessTransport::new(4);
    assert_eq!(
        t.send(NodeId(3), chunk(0), soon()),
        Err(TransportError::Unreachable(NodeId(3)))
    );
    let rx = t.bind(NodeId(3)).unwrap();
    assert_eq!(
        t.bind(NodeId(3)).err(),
        Some(TransportError::AlreadyBound(NodeId(3)))
    );
    drop(rx);
    assert_eq!(
        t.send(NodeId(3), chunk(0), soon()),
        Err(TransportError::Unreachable(NodeId(3)))
    );
    t.unbind(NodeId(3));
    let _rx = t.bind(NodeId(3)).unwrap();
    t.send(NodeId(3), chunk(0), soon()).unwrap();
}
