//! A TCP proxy the test controls, to inject network faults into one
//! client's connection: cut it silently (a partition: packets vanish,
//! nothing is refused), or hold every byte and deliver it late (packets
//! sitting in the network).

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with the bytes it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward them.
    Pass,
    /// Drop them.
    Cut,
    /// Keep them, in order, until the mode is `Pass` again.
    Hold,
    /// Close every connection, and each new one at once (a server gone:
    /// the client sees errors at once, not silence).
    Refuse,
}

/// A running proxy to `upstream`.
#[derive(Debug, Clone)]
pub struct Proxy {
    pub port: u16,
    mode: watch::Sender<Mode>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (mode, _) = watch::channel(Mode::Pass);
        let m = mode.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *m.borrow() == Mode::Refuse {
                    drop(client);
                    continue;
                }
                let (upstream, m) = (upstream.clone(), m.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        let (cr, cw) = client.into_split();
                        let (sr, sw) = server.into_split();
                        tokio::join!(pump(cr, sw, m.subscribe()), pump(sr, cw, m.subscribe()));
                    }
                });
            }
        });
        Ok(Self { port, mode })
    }

    /// From now on every byte in either direction is dropped; connections
    /// stay open, new ones are accepted and starved too.
    pub fn cut(&self) {
        self.mode.send_replace(Mode::Cut);
    }

    /// From now on every byte is held back (delivered by [`Proxy::restore`]).
    pub fn hold(&self) {
        self.mode.send_replace(Mode::Hold);
    }

    /// From now on connections are closed (see [`Mode::Refuse`]).
    pub fn refuse(&self) {
        self.mode.send_replace(Mode::Refuse);
    }

    /// Forward again; bytes held so far are delivered first, in order.
    pub fn restore(&self) {
        self.mode.send_replace(Mode::Pass);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut held: Vec<u8> = Vec::new();
    loop {
        let current = *mode.borrow_and_update();
        if current == Mode::Refuse {
            return;
        }
        if current == Mode::Pass && !held.is_empty() {
            if to.write_all(&held).await.is_err() {
                return;
            }
            held.clear();
        }
        tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let now = *mode.borrow();
                    match now {
                    Mode::Cut => {} // black hole
                    Mode::Refuse => return,
                    Mode::Hold => held.extend_from_slice(&buf[..n]),
                    Mode::Pass => {
                        if !held.is_empty() {
                            held.extend_from_slice(&buf[..n]);
                        } else if to.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                    }
                }
            },
            r = mode.changed() => if r.is_err() { return },
        }
    }
}

/// A copy of the kubeconfig at `KUBECONFIG` whose server is the proxy,
/// written to `dir` (0600: it is the admin's). Named after the proxy's
/// port, so one directory can hold the copies for several proxies.
pub fn proxied_kubeconfig(
    proxy: &Proxy,
    dir: &crate::secrets::PrivateDir,
) -> anyhow::Result<std::path::PathBuf> {
    let path = std::env::var("KUBECONFIG")?;
    let text = std::fs::read_to_string(&path)?;
    let server = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: "))
        .ok_or_else(|| anyhow::anyhow!("no server in {path}"))?
        .to_owned();
    let proxied = text.replace(&server, &format!("https://127.0.0.1:{}", proxy.port));
    dir.write(&format!("kubeconfig-proxied-{}", proxy.port), &proxied)
}

/// host:port of the API server in `KUBECONFIG`.
pub fn apiserver_addr() -> anyhow::Result<String> {
    let text = std::fs::read_to_string(std::env::var("KUBECONFIG")?)?;
    let server = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: https://"))
        .ok_or_else(|| anyhow::anyhow!("no https server in KUBECONFIG"))?;
    Ok(server.trim().to_owned())
}
