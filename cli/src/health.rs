//! `kvmesh health`: the container health check (the images carry no curl). Exits 0 when
//! the URL answers 2xx, 1 otherwise, printing what it got.

use crate::config::env_vars;
use anyhow::{bail, Context, Result};
use clap::Args;
use humantime_serde::re::humantime;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct HealthArgs {
    /// What to ask: a node's `/health` on its metrics port (the default), or a router's
    /// `/health` on its API port.
    #[arg(long, env = env_vars::HEALTH_URL, default_value = "http://127.0.0.1:9100/health")]
    pub url: String,
    /// How long to wait for the answer.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

pub fn run(args: &HealthArgs) -> Result<()> {
    let (host, path) = split_url(&args.url)?;
    let (status, body) =
        http_get(host, path, args.timeout).with_context(|| format!("GET {}", args.url))?;
    let body = body.trim();
    if !(200..300).contains(&status) {
        bail!("GET {} answered {status}: {body}", args.url);
    }
    println!("{body}");
    Ok(())
}

/// `http://host:port/path` → (`host:port`, `/path`).
fn split_url(url: &str) -> Result<(&str, &str)> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("{url}: only http:// URLs can be checked"))?;
    Ok(match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    })
}

/// One `GET` over HTTP/1.1 with `Connection: close`: the status code and the body.
pub fn http_get(host: &str, path: &str, timeout: Duration) -> Result<(u16, String)> {
    let addr = host
        .to_socket_addrs()?
        .next()
        .with_context(|| format!("{host} resolves to no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("not an HTTP answer: {head:?}"))?;
    Ok((status, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_host_and_path() {
        assert_eq!(
            split_url("http://127.0.0.1:9100/health").unwrap(),
            ("127.0.0.1:9100", "/health")
        );
        assert_eq!(
            split_url("http://router:8000").unwrap(),
            ("router:8000", "/")
        );
        assert!(split_url("https://x/health").is_err());
    }
}
