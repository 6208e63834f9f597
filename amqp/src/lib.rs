//! The one way the controller and the host agent open a broker connection
//! (docs/decisions/0045).
//!
//! [`connect`] gives an attempt one deadline for everything it waits on:
//! name resolution, the TCP connect, the TLS handshake and the AMQP handshake
//! up to `Connection.Open-Ok`. A peer that accepts the TCP connection and then
//! says nothing (a dead broker behind a load balancer, a stalled forwarder, a
//! port some other program took) fails the attempt at the deadline, and the
//! caller moves on to its next endpoint.
//!
//! Dropping lapin's connect future is not enough for that: lapin drives each
//! connection from an I/O thread of its own, which would go on waiting for
//! the silent peer after the future is gone, one thread and one socket per
//! failed attempt for as long as the peer stays silent. So the attempt keeps
//! a duplicate of its socket's descriptor and, past the deadline, shuts the
//! socket down: the I/O thread sees the end of the stream and exits.
//!
//! [`close`] bounds the other wait a caller can meet on a dead peer: a
//! graceful close waits for the broker's `Close-Ok`.
//!
//! What this crate never does: retry (the callers own their endpoint lists
//! and backoff), log a URL (it may hold a password), or touch a database.

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::tcp::{AsyncTcpStream, OwnedTLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};

/// Why an attempt did not give a connection.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Nothing answered in time: the TCP connect, the TLS handshake or the
    /// AMQP handshake was still waiting at the deadline.
    #[error(
        "no answer within {}s (TCP connect, TLS and AMQP handshakes)",
        .0.as_secs_f64()
    )]
    TimedOut(Duration),
    /// The broker or the network said no (refused, reset, a TLS or AMQP
    /// error, the credentials refused).
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
}

/// The socket of an attempt in progress, kept so that it can be shut down.
#[derive(Default, Clone)]
struct Socket(Arc<Mutex<Option<OwnedFd>>>);

impl Socket {
    fn keep(&self, fd: OwnedFd) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(fd);
    }

    /// Shut the kept socket down (both ways) and let the duplicate go.
    fn shut(&self) {
        if let Some(fd) = self.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // shutdown(2) acts on the socket, not on this descriptor: lapin's
            // own descriptor of it sees the end of the stream.
            let _ = rustix::net::shutdown(&fd, rustix::net::Shutdown::Both);
        }
    }

    /// Let the duplicate go, leaving the socket as it is.
    fn release(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// Connects to the host and port `uri` names (TLS per its scheme with
/// `tls`), the whole attempt within `deadline` (see the crate's docs).
///
/// Guarantees: an `Err` leaves no socket open and no lapin I/O thread
/// waiting on this attempt's peer. Caveats: `deadline` is not clamped; a
/// zero deadline fails every attempt.
pub async fn connect(
    uri: AMQPUri,
    props: ConnectionProperties,
    tls: OwnedTLSConfig,
    deadline: Duration,
) -> Result<Connection, ConnectError> {
    let runtime = lapin::runtime::default_runtime()?;
    let socket = Socket::default();
    let kept = socket.clone();
    let attempt = Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, runtime| {
            let host = uri.authority.host.as_str();
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, uri.authority.port))
                .await
                .map_err(lapin::Error::from)?
                .collect();
            let stream = AsyncTcpStream::connect(&runtime, addrs)
                .await
                .map_err(lapin::Error::from)?;
            if let AsyncTcpStream::Plain(plain) = &stream
                && let Ok(fd) = plain.get_ref().as_fd().try_clone_to_owned()
            {
                kept.keep(fd);
            }
            match uri.scheme {
                AMQPScheme::AMQP => Ok(stream),
                AMQPScheme::AMQPS => stream
                    .into_tls(&uri.authority.host, tls.as_ref())
                    .await
                    .map_err(lapin::Error::from),
            }
        },
        props,
    );
    match tokio::time::timeout(deadline, attempt).await {
        Ok(Ok(conn)) => {
            socket.release();
            Ok(conn)
        }
        Ok(Err(e)) => {
            socket.shut();
            Err(ConnectError::Amqp(e))
        }
        Err(_) => {
            socket.shut();
            Err(ConnectError::TimedOut(deadline))
        }
    }
}

/// Closes `conn` gracefully, waiting at most `deadline` for the broker's
/// answer; a connection already closed or failed returns at once. True if the
/// broker acknowledged the close.
pub async fn close(conn: &Connection, reason: &str, deadline: Duration) -> bool {
    if !conn.status().connected() {
        return false;
    }
    matches!(
        tokio::time::timeout(deadline, conn.close(200, reason.into())).await,
        Ok(Ok(()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threads of this process named `name` (Linux: /proc/self/task).
    fn threads_named(name: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|tasks| {
                tasks
                    .filter_map(|t| t.ok())
                    .filter(|t| {
                        std::fs::read_to_string(t.path().join("comm"))
                            .is_ok_and(|c| c.trim() == name)
                    })
                    .count()
            })
            .unwrap_or(0)
    }

    /// A listener that accepts and never says a word: the attempt fails at
    /// its deadline, and neither lapin's I/O thread nor the socket outlives
    /// it (the peer sees the connection end).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_peer_fails_at_the_deadline_and_leaves_nothing() -> anyhow::Result<()> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let uri: AMQPUri = format!("amqp://u:p@127.0.0.1:{port}/%2f")
            .parse()
            .map_err(anyhow::Error::msg)?;
        let before = threads_named("lapin-io-loop");
        let attempt = tokio::spawn(connect(
            uri,
            ConnectionProperties::default(),
            OwnedTLSConfig::default(),
            Duration::from_millis(500),
        ));
        let (mut peer, _) =
            tokio::time::timeout(Duration::from_secs(10), listener.accept()).await??;
        let started = std::time::Instant::now();
        let outcome = attempt.await?;
        assert!(
            matches!(outcome, Err(ConnectError::TimedOut(_))),
            "{outcome:?}"
        );
        // The peer reads the protocol header, then the end of the stream.
        let mut buf = [0u8; 64];
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            use tokio::io::AsyncReadExt as _;
            loop {
                match peer.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "the attempt's socket outlived it");
        // lapin's I/O thread of the attempt ends.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while threads_named("lapin-io-loop") > before {
            assert!(
                std::time::Instant::now() < deadline,
                "lapin's I/O thread outlived the attempt ({} threads)",
                threads_named("lapin-io-loop")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        Ok(())
    }

    /// A port nobody listens on: refused at once, not at the deadline; an
    /// IPv6 literal (in brackets in the URL) is reached the same way.
    #[tokio::test]
    async fn a_refused_connect_fails_at_once() -> anyhow::Result<()> {
        for (bind, host) in [("127.0.0.1:0", "127.0.0.1"), ("[::1]:0", "[::1]")] {
            let port = std::net::TcpListener::bind(bind)?.local_addr()?.port();
            let uri: AMQPUri = format!("amqp://u:p@{host}:{port}/%2f")
                .parse()
                .map_err(anyhow::Error::msg)?;
            let outcome = connect(
                uri,
                ConnectionProperties::default(),
                OwnedTLSConfig::default(),
                Duration::from_secs(60),
            )
            .await;
            let refused =
                matches!(&outcome, Err(ConnectError::Amqp(e)) if e.to_string().contains("refused"));
            assert!(refused, "{host}: {outcome:?}");
        }
        Ok(())
    }
}
