//! Choosing ports for processes about to be started.

use std::collections::HashSet;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::Mutex;

/// A TCP port on `ip` that is free now and that this process has not handed out before, for a
/// child (or a server) that binds it later. The OS may give a port it just released to the
/// next `bind(0)`; two nodes handed one port would then race for it.
pub fn free_addr(ip: &str) -> io::Result<SocketAddr> {
    static GIVEN: Mutex<Option<HashSet<SocketAddr>>> = Mutex::new(None);
    // The probes are held until one is new, so the OS cannot offer a rejected port again.
    let mut held = Vec::new();
    loop {
        let probe = TcpListener::bind((ip, 0))?;
        let addr = probe.local_addr()?;
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if given.get_or_insert_with(HashSet::new).insert(addr) {
            return Ok(addr);
        }
        held.push(probe);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_hands_out_one_port_twice() {
        let addrs: Vec<SocketAddr> = (0..200).map(|_| free_addr("127.0.0.1").unwrap()).collect();
        let distinct: HashSet<_> = addrs.iter().collect();
        assert_eq!(distinct.len(), addrs.len());
        assert!(addrs.iter().all(|a| a.ip().to_string() == "127.0.0.1"));
    }
}
