//! A TCP fault proxy on loopback, between dblock and a database server: it passes bytes through,
//! or holds, drops, delays or cuts them on command, so the worst moments of a network happen in
//! a test exactly when it wants them.
//!
//! ```text
//! let proxy = Proxy::start("127.0.0.1:5432").await;   // then connect to proxy.url(...)
//! proxy.set(Mode::HoldReplies);                        // the server's replies stop arriving
//! proxy.reset_all();                                   // every open connection: RST
//! proxy.set(Mode::Refuse);                             // new connections are refused
//! proxy.set(Mode::Pass);
//! proxy.set_target("127.0.0.1:5434");                  // new connections go there (failover)
//! ```

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Pass everything through.
    Pass,
    /// Client → server passes; server → client bytes are held back (a lost reply), and
    /// released if the mode goes back to `Pass` (another mode keeps them held).
    HoldReplies,
    /// Client → server bytes are dropped (a lost send); replies pass.
    DropSends,
    /// Nothing passes either way and nothing is said: a silent partition. New connections are
    /// accepted and then hang.
    Blackhole,
    /// New connections are closed at once (as a server that is down); open ones carry on.
    Refuse,
    /// Server → client bytes are delayed by this long.
    DelayReplies(Duration),
}

struct Shared {
    mode: watch::Sender<Mode>,
    /// Where new connections go (`host:port`).
    target: Mutex<String>,
    /// One sender per open connection; sending on it resets that connection.
    resets: Mutex<Vec<watch::Sender<bool>>>,
    /// Connections accepted and forwarded, and connections refused (`Mode::Refuse`), so far.
    accepted: AtomicUsize,
    refused: AtomicUsize,
}

/// A running proxy; dropping it stops accepting (open connections end with their peers).
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset_all();
    }
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target` (`host:port`).
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Mode::Pass);
        let shared = Arc::new(Shared {
            mode,
            target: Mutex::new(target.to_owned()),
            resets: Mutex::default(),
            accepted: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
        });
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let mode = *s.mode.borrow();
                if mode == Mode::Refuse {
                    s.refused.fetch_add(1, Ordering::SeqCst);
                    rst(&client);
                    drop(client);
                    continue;
                }
                s.accepted.fetch_add(1, Ordering::SeqCst);
                let (reset_tx, reset_rx) = watch::channel(false);
                s.resets.lock().unwrap().push(reset_tx);
                let target = s.target.lock().unwrap().clone();
                let s = s.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&target).await else {
                        return;
                    };
                    connection(client, server, &s, reset_rx).await;
                });
            }
        });
        Proxy {
            addr,
            shared,
            accept,
        }
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let userinfo = authority
            .rsplit_once('@')
            .map(|(u, _)| format!("{u}@"))
            .unwrap_or_default();
        format!("{scheme}://{userinfo}{}/{path}", self.addr)
    }

    /// Where the proxy listens (a dropped proxy's port is closed: connecting is refused).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many connections the proxy accepted and forwarded so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// How many connections the proxy refused (`Mode::Refuse`) so far.
    pub fn refused(&self) -> usize {
        self.shared.refused.load(Ordering::SeqCst)
    }

    pub fn set(&self, mode: Mode) {
        self.shared.mode.send_replace(mode);
    }

    /// Sends new connections to `target` (`host:port`) from now on, as a load balancer does after
    /// a failover; open connections stay where they are (`reset_all` ends them).
    pub fn set_target(&self, target: &str) {
        *self.shared.target.lock().unwrap() = target.to_owned();
    }

    /// Resets every open connection (RST), as a crashed router or a killed server would.
    pub fn reset_all(&self) {
        for r in self.shared.resets.lock().unwrap().drain(..) {
            let _ = r.send(true);
        }
    }

    /// Cuts the clients off: every open connection reset, new ones refused, and nothing held
    /// back (a lost reply) gets through. The resets go out before `Refuse` is set: under
    /// `Refuse` an open connection would carry on, so a reply that reached the proxy between
    /// the two would otherwise be delivered.
    pub fn cut_off(&self) {
        self.reset_all();
        self.set(Mode::Refuse);
    }
}

async fn connection(
    client: TcpStream,
    server: TcpStream,
    shared: &Arc<Shared>,
    mut reset: watch::Receiver<bool>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = pump(&mut cr, &mut sw, shared.mode.subscribe(), Direction::Sends);
    let down = pump(
        &mut sr,
        &mut cw,
        shared.mode.subscribe(),
        Direction::Replies,
    );
    // A reset wins over traffic ready at the same poll: nothing passes once it is sent.
    tokio::select! {
        biased;
        _ = reset.wait_for(|r| *r) => {}
        _ = up => {}
        _ = down => {}
    }
    // Reset both sides: linger 0 makes the close an RST.
    let client = cr.reunite(cw).ok();
    let server = sr.reunite(sw).ok();
    for s in [client, server].into_iter().flatten() {
        rst(&s);
    }
}

/// Makes closing `s` an RST (linger 0), as a crash or a router reset would.
#[allow(deprecated)] // blocking on drop is what a non-zero linger does; zero never blocks
fn rst(s: &TcpStream) {
    let _ = s.set_linger(Some(Duration::ZERO));
}

#[derive(Clone, Copy, PartialEq)]
enum Direction {
    Sends,
    Replies,
}

async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    dir: Direction,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut held: Vec<u8> = Vec::new();
    loop {
        let n = tokio::select! {
            n = from.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            // A mode change may release what was held.
            _ = mode.changed() => {
                if *mode.borrow() == Mode::Pass && !held.is_empty() {
                    if to.write_all(&held).await.is_err() {
                        return;
                    }
                    held.clear();
                }
                continue;
            }
        };
        let now = *mode.borrow();
        match (now, dir) {
            (Mode::Blackhole, _) | (Mode::HoldReplies, Direction::Replies) => {
                held.extend_from_slice(&buf[..n])
            }
            (Mode::DropSends, Direction::Sends) => {}
            // What was held back stays behind, in order, until `Pass` lets it go: a reply held
            // and then a switch to `Refuse` (the test's "and reconnecting fails") must stay
            // lost, even when the rest of that reply reaches the proxy after the switch.
            _ if now != Mode::Pass && !held.is_empty() => held.extend_from_slice(&buf[..n]),
            (Mode::DelayReplies(d), Direction::Replies) => {
                tokio::time::sleep(d).await;
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
            _ => {
                if to.write_all(&held).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                held.clear();
            }
        }
    }
}
