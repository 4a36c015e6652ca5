//! Ports for the servers these tests start. A port found free is free only at the moment it
//! is found: a concurrent test's connection or listener can take it before the server binds
//! it. So a server is started on fresh ports until one start comes up, and it counts as up
//! only once the server's own process listens on its port (not when something answers there).

use std::net::TcpListener;

/// Starts at bringing a server up on fresh ports before a test gives up.
pub(crate) const PORT_TRIES: usize = 5;

/// A loopback port free when asked.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `start(attempt)` until it returns the started server, at most [`PORT_TRIES`] times; each
/// attempt picks its own ports, and says why it did not come up. Panics with every reason.
pub(crate) fn on_fresh_ports<T>(
    what: &str,
    mut start: impl FnMut(usize) -> Result<T, String>,
) -> T {
    let mut failures = Vec::new();
    for attempt in 0..PORT_TRIES {
        match start(attempt) {
            Ok(server) => return server,
            Err(why) => failures.push(why),
        }
    }
    panic!("{what} did not start on any of {PORT_TRIES} tries of fresh ports: {failures:#?}")
}

/// Whether process `pid` holds a TCP socket listening on `port`, in its own network
/// namespace: the sockets `/proc/<pid>/net/tcp{,6}` lists in state LISTEN on that port, one
/// of which must be among the process's open files.
pub(crate) fn listens(pid: u32, port: u16) -> bool {
    let inodes: Vec<String> = ["tcp", "tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).ok())
        .flat_map(|table| {
            table.lines().skip(1).filter_map(|row| listening_inode(row, port)).collect::<Vec<_>>()
        })
        .collect();
    if inodes.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| {
            let target = target.to_string_lossy();
            inodes.iter().any(|inode| target == format!("socket:[{inode}]"))
        })
    })
}

/// The inode of a `/proc/net/tcp` row listening (state `0A`) on `port`.
fn listening_inode(row: &str, port: u16) -> Option<String> {
    let fields: Vec<&str> = row.split_whitespace().collect();
    let local_port = u16::from_str_radix(fields.get(1)?.rsplit_once(':')?.1, 16).ok()?;
    (local_port == port && *fields.get(3)? == "0A").then(|| fields.get(9).map(|s| s.to_string()))?
}

#[test]
fn a_port_counts_as_listened_on_only_by_the_process_holding_its_listener() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    assert!(listens(std::process::id(), port), "this process listens on {port}");
    // The port answers (a connection succeeds) for any process, but only its holder listens.
    let _answered = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut other = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let without = listens(other.id(), port);
    let _ = other.kill();
    let _ = other.wait();
    assert!(!without, "a process without the listener");
    drop(held);
    assert!(!listens(std::process::id(), port), "a closed listener");
}

#[test]
fn a_start_that_did_not_come_up_is_tried_again_and_every_reason_is_kept() {
    let mut tried = Vec::new();
    let up = on_fresh_ports("a server", |attempt| {
        tried.push(attempt);
        if attempt < 2 { Err(format!("port taken on try {attempt}")) } else { Ok(attempt) }
    });
    assert_eq!((up, tried), (2, vec![0, 1, 2]));
    let all_failed = std::panic::catch_unwind(|| {
        on_fresh_ports::<()>("a server", |attempt| Err(format!("taken {attempt}")))
    })
    .unwrap_err();
    let why = all_failed.downcast_ref::<String>().unwrap();
    assert!(why.contains("taken 0") && why.contains(&format!("taken {}", PORT_TRIES - 1)), "{why}");
}
