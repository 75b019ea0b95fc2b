/* lb-agent: layerbox's guest agent (docs/FORMAT.md, Part 5, "The agent protocol").
 *
 * Runs in the guest's initramfs, never in the user's image: the init script mounts the
 * image's layers and execs this with argv[1] the virtio-serial port named "lb.agent".
 * Asked to (T_MOUNT, after a template restore), it reseeds the kernel's random number
 * generator from the host's bytes, mounts the sandbox's own disk, composes its root at
 * argv[2] and chroots there; then it serves
 * commands with streamed output, signals, stdin, terminals (a pty it makes, resized on
 * request), TCP connections to the guest's own 127.0.0.1 relayed both ways under credit
 * (ports), directory watches (inotify in a child of its own, run as the caller's account),
 * and file operations.
 *
 * The host trusts nothing it reads here (a guest runs anything, this agent included);
 * this side trusts the host.  One thread, one poll loop: the port, every command's
 * stdout/stderr, and a signalfd for SIGCHLD; file reads and listings are streams served
 * from the loop a frame at a time, never more than the host's credit for them, so one
 * the host is slow to take waits without holding up the others.  Built static by
 * sandbox/backends/vm/assets.py.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <linux/random.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define AGENT_VERSION "lb-agent/3" /* 3: terminals (PTY, RESIZE), ports (CONNECT...), WATCH */
#define MAX_FRAME (1u << 20) /* the host never sends more in one frame */
#define IO_CHUNK (256u << 10)
#define MAX_PROCS 256
#define MAX_STREAMS 16
#define MAX_PORTS 64 /* relayed TCP connections at once */
#define MAX_WATCH_DIRS 1024 /* directories one watch follows (the edge's for a container's) */
#define NO_CREDIT INT64_MAX /* a READ or LIST without a credit: a host from before credit takes it all */
#define TOKEN 16 /* bytes of the host's HELLO its answer starts with */

enum {
	T_PING = 1, T_PONG = 2, T_EXEC = 3, T_STARTED = 4, T_STDIN = 5, T_SIGNAL = 6,
	T_READ = 7, T_DATA = 8, T_END = 9, T_WRITE = 10, T_LIST = 11, T_STAT = 12,
	T_REMOVE = 13, T_MKDIR = 14, T_SYNC = 15, T_ENTRY = 16, T_MOUNT = 17, T_NET = 18, T_MORE = 19,
	T_STDOUT = 20, T_STDERR = 21, T_EXIT = 22, T_HELLO = 23,
	T_PTY = 24, T_RESIZE = 25, T_CONNECT = 26, T_OPENED = 27, T_SHUT = 28, T_CLOSE = 29, T_WATCH = 30, T_READY = 100,
};

struct proc {
	uint32_t chan;
	pid_t pid;
	int out, err, in; /* -1 once closed */
	char *inbuf;      /* stdin the child has not taken yet */
	size_t inlen;
	int in_eof;
	int orphan;       /* started for an earlier host connection: its output and exit go nowhere */
	int tty;          /* out (and in, a dup) is a pty's master */
	int watch;        /* a WATCH's child: nobody's once its host connection is gone */
};

/* A TCP connection to 127.0.0.1:<port> relayed for the host: its bytes to the host under the
 * host's credit (DATA, MORE), the host's to it as they come (the host sends no more than its
 * window: each MORE this side sends gives back what the socket took) */
struct portc {
	uint32_t chan;
	int fd;           /* -1: a free slot */
	int connecting;
	int64_t credit;   /* bytes the host takes before it sends MORE */
	char *out;        /* the host's bytes the socket has not taken yet */
	size_t outlen;
	int rd_eof;       /* the socket's end of input was read (SHUT sent) */
	int wr_eof;       /* the host's END came: once out is written, shutdown(SHUT_WR) */
	int shut;         /* shut down for writing */
};

/* A READ or a LIST being answered: one frame per turn of the loop while credit is left */
struct stream {
	char *path;       /* NULL: a free slot */
	uint32_t chan;
	int fd;           /* a READ's file, else -1 */
	DIR *dir;         /* a LIST's directory, else NULL */
	int64_t credit;   /* payload bytes the host takes before it sends MORE */
};

static int port = -1;
static int mounted;
static const char *root_dir;
static struct proc procs[MAX_PROCS];
static struct stream streams[MAX_STREAMS];
static struct portc ports[MAX_PORTS];
static int writing = -1;     /* the file a T_WRITE stream goes to */
static uint32_t writing_chan;
static char writing_tmp[4096], writing_path[4096];

static void die(const char *what)
{
	fprintf(stderr, "lb-agent: %s: %s\n", what, strerror(errno));
	exit(1);
}

static void put32(unsigned char *p, uint32_t v)
{
	p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static uint32_t get32(const unsigned char *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void write_all(const void *buf, size_t len)
{
	const char *p = buf;
	while (len) {
		ssize_t n = write(port, p, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN) {
				struct pollfd pf = {port, POLLOUT, 0};
				poll(&pf, 1, 100);
				continue;
			}
			return; /* the host went away: what it missed it asks for again */
		}
		p += n;
		len -= n;
	}
}

static void send_frame(int type, uint32_t chan, const void *payload, size_t len)
{
	unsigned char head[9];
	put32(head, (uint32_t)(len + 5));
	head[4] = type;
	put32(head + 5, chan);
	write_all(head, 9);
	if (len)
		write_all(payload, len);
}

/* END: errno 0 is success; otherwise a message that names the path */
static void send_end(uint32_t chan, int err, const char *what, const char *path)
{
	char buf[4096 + 256];
	int n = 4;
	put32((unsigned char *)buf, (uint32_t)err);
	if (err)
		n += snprintf(buf + 4, sizeof buf - 4, "%s %s: %s", what, path, strerror(err));
	send_frame(T_END, chan, buf, n > (int)sizeof buf ? (int)sizeof buf : n);
}

/* payload reader: length-prefixed strings and u32s; a short payload is an error */
struct rd { const unsigned char *p, *end; int bad; };

static uint32_t rd32(struct rd *r)
{
	if (r->end - r->p < 4) { r->bad = 1; return 0; }
	uint32_t v = get32(r->p);
	r->p += 4;
	return v;
}

static char *rdstr(struct rd *r)
{
	uint32_t n = rd32(r);
	if (r->bad || (uint32_t)(r->end - r->p) < n) { r->bad = 1; return NULL; }
	char *s = malloc(n + 1);
	if (!s) die("malloc");
	memcpy(s, r->p, n);
	s[n] = 0;
	r->p += n;
	return s;
}

static struct proc *find(uint32_t chan)
{
	for (int i = 0; i < MAX_PROCS; i++)
		if (procs[i].pid > 0 && !procs[i].orphan && procs[i].chan == chan)
			return &procs[i];
	return NULL;
}

static void nonblock(int fd)
{
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

/* -- watches: a child of the agent's, as the caller's account, reports inotify events ------------ */
/* A watch's output, records of: mask (u32, the kernel's; 0 for the watch's own), the name's length
 * (u32), the name (relative to the watched directory, "" for itself).  Its own: "ready" once
 * every directory is watched, "sync" for each byte on its stdin, after every event queued
 * before that byte.  Its exit status: 0 when the directory is gone, else an errno (stderr
 * says more): what it could not watch, E2BIG past MAX_WATCH_DIRS, EOVERFLOW when the
 * kernel's queue overflowed. */
static struct { int wd; char *rel; } wdirs[MAX_WATCH_DIRS];
static int nwdirs;
static const char *wroot;
static const uint32_t WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
	| IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR;

static void emit(uint32_t mask, const char *name)
{
	size_t n = strlen(name);
	unsigned char head[8];
	put32(head, mask);
	put32(head + 4, (uint32_t)n);
	if (write(1, head, 8) != 8 || (n && write(1, name, n) != (ssize_t)n)) _exit(EPIPE); /* the host left */
}

static void watch_fail(int err, const char *what, const char *rel)
{
	fprintf(stderr, "%s %s/%s: %s\n", what, wroot, rel, strerror(err));
	_exit(err);
}

static char *join(const char *a, const char *b)
{
	char *out;
	if (asprintf(&out, "%s%s%s", a, *a && *b ? "/" : "", b) < 0) die("asprintf");
	return out;
}

/* ``rel`` (and with ``recursive`` each directory under it) watched; with ``report`` every entry
 * in them is told as created (a directory made under a recursive watch: what it held before
 * its watch was added) */
static void watch_tree(int ifd, const char *rel, int recursive, int report)
{
	char *path = join(wroot, rel);
	if (nwdirs == MAX_WATCH_DIRS) watch_fail(E2BIG, "more directories than 1024 to watch under", "");
	int wd = inotify_add_watch(ifd, path, WATCH_MASK | IN_DONT_FOLLOW);
	if (wd < 0) {
		int err = errno;
		free(path);
		if (*rel && (err == ENOENT || err == ENOTDIR)) return; /* gone again already */
		watch_fail(err, "watch", rel);
	}
	wdirs[nwdirs].wd = wd;
	wdirs[nwdirs++].rel = strdup(rel);
	DIR *d = recursive || report ? opendir(path) : NULL;
	free(path);
	struct dirent *de;
	while (d && (de = readdir(d))) {
		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
		char *child = join(rel, de->d_name);
		if (report) emit(IN_CREATE, child);
		struct stat cst;
		int dir = de->d_type == DT_DIR
			|| (de->d_type == DT_UNKNOWN && !fstatat(dirfd(d), de->d_name, &cst, AT_SYMLINK_NOFOLLOW) && S_ISDIR(cst.st_mode));
		if (recursive && dir) watch_tree(ifd, child, 1, report);
		free(child);
	}
	if (d) closedir(d);
}

static int watched(int wd)
{
	for (int i = 0; i < nwdirs; i++)
		if (wdirs[i].wd == wd) return i;
	return -1;
}

/* What the kernel queued, told; 0 when nothing was queued */
static int watch_read(int ifd, int recursive)
{
	static char buf[64 << 10] __attribute__((aligned(__alignof__(struct inotify_event))));
	ssize_t n = read(ifd, buf, sizeof buf);
	if (n <= 0) return 0;
	for (char *p = buf; p < buf + n;) {
		struct inotify_event *ev = (struct inotify_event *)p;
		p += sizeof *ev + ev->len;
		if (ev->mask & IN_Q_OVERFLOW) watch_fail(EOVERFLOW, "the kernel's event queue overflowed for", "");
		int i = watched(ev->wd);
		if (i < 0) continue;
		if (ev->mask & IN_IGNORED) {
			free(wdirs[i].rel);
			wdirs[i] = wdirs[--nwdirs];
			if (!nwdirs) _exit(0); /* the watched directory is gone */
			continue;
		}
		const char *rel = wdirs[i].rel;
		if (ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF) && *rel) continue; /* its parent tells it */
		char *where = join(rel, ev->len ? ev->name : "");
		emit(ev->mask, where);
		if (recursive && ev->mask & IN_ISDIR && ev->mask & (IN_CREATE | IN_MOVED_TO))
			watch_tree(ifd, where, 1, 1);
		free(where);
	}
	return 1;
}

static void watch_main(const char *path, int recursive)
{
	wroot = path;
	int ifd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
	if (ifd < 0) watch_fail(errno, "inotify for", "");
	struct stat st;
	if (stat(path, &st)) watch_fail(errno, "watch", "");
	if (!S_ISDIR(st.st_mode)) watch_fail(ENOTDIR, "watch", "");
	watch_tree(ifd, "", recursive, 0);
	emit(0, "ready");
	for (;;) {
		struct pollfd pf[2] = {{ifd, POLLIN, 0}, {0, POLLIN, 0}};
		if (poll(pf, 2, -1) < 0 && errno != EINTR) watch_fail(errno, "poll", "");
		if (pf[0].revents) watch_read(ifd, recursive);
		if (pf[1].revents) {
			char c[64];
			ssize_t n = read(0, c, sizeof c);
			if (n <= 0) _exit(0); /* the host ended the watch */
			while (watch_read(ifd, recursive)) {}
			for (ssize_t i = 0; i < n; i++) emit(0, "sync");
		}
	}
}

/* A pty's master (nonblocking) and its slave's path; -1 on failure (errno set) */
static int open_pty(char *slave, size_t n, uint32_t cols, uint32_t rows)
{
	int m = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (m < 0) m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (m < 0) return -1;
	struct winsize ws = {.ws_row = rows, .ws_col = cols};
	if (unlockpt(m) || ptsname_r(m, slave, n) || ioctl(m, TIOCSWINSZ, &ws)) {
		int err = errno;
		close(m);
		errno = err;
		return -1;
	}
	return m;
}

/* In the child of a command on a terminal: a session of its own whose controlling terminal
 * is the pty (opened without O_NOCTTY by the session leader, and TIOCSCTTY to be sure), its
 * stdin, stdout and stderr; owned by the command's account, as a login's terminal is */
static int take_pty(const char *slave, uint32_t uid, uint32_t gid)
{
	int s = open(slave, O_RDWR);
	if (s < 0) return errno;
	if (ioctl(s, TIOCSCTTY, 0) && errno != EPERM) return errno;
	if (fchown(s, uid, gid)) {} /* a terminal the account cannot chmod is still its terminal */
	dup2(s, 0); dup2(s, 1); dup2(s, 2);
	if (s > 2) close(s);
	return 0;
}

enum { RUN_EXEC, RUN_PTY, RUN_WATCH };

/* EXEC, PTY (a terminal's cols and rows first) and WATCH (argv: the directory, then
 * "recursive" or not; run by this agent's code in the child, as the account) */
static void do_exec(uint32_t chan, struct rd *r, int mode)
{
	int tty = mode == RUN_PTY;
	uint32_t cols = tty ? rd32(r) : 0, rows = tty ? rd32(r) : 0;
	uint32_t uid = rd32(r), gid = rd32(r);
	char *cwd = rdstr(r);
	uint32_t argc = rd32(r);
	if (r->bad || argc == 0 || argc > 65536) { send_end(chan, EINVAL, "exec", "(request)"); return; }
	char **argv = calloc(argc + 1, sizeof *argv);
	for (uint32_t i = 0; i < argc && !r->bad; i++)
		argv[i] = rdstr(r);
	uint32_t envc = rd32(r);
	if (r->bad || envc > 65536) { send_end(chan, EINVAL, "exec", "(request)"); return; }
	char **envp = calloc(envc + 1, sizeof *envp);
	for (uint32_t i = 0; i < envc && !r->bad; i++)
		envp[i] = rdstr(r);
	if (r->bad) { send_end(chan, EINVAL, "exec", "(request)"); return; }

	struct proc *slot = NULL;
	for (int i = 0; i < MAX_PROCS; i++)
		if (procs[i].pid <= 0) { slot = &procs[i]; break; }
	int o[2] = {-1, -1}, e[2] = {-1, -1}, in[2] = {-1, -1}, ep[2];
	char slave[64] = "";
	if (!slot || find(chan)) {
		send_end(chan, slot ? EEXIST : EAGAIN, "exec", argv[0]);
		goto out;
	}
	if (tty) {
		/* the master is the command's output (o[0]) and, a dup of it, its input (in[1]) */
		if ((o[0] = open_pty(slave, sizeof slave, cols, rows)) < 0 || (in[1] = fcntl(o[0], F_DUPFD_CLOEXEC, 3)) < 0
		    || pipe2(ep, O_CLOEXEC)) {
			send_end(chan, errno, "terminal", argv[0]);
			if (o[0] >= 0) close(o[0]);
			if (in[1] >= 0) close(in[1]);
			goto out;
		}
	} else if (pipe2(o, O_CLOEXEC) || pipe2(e, O_CLOEXEC) || pipe2(in, O_CLOEXEC) || pipe2(ep, O_CLOEXEC)) {
		send_end(chan, errno, "exec", argv[0]);
		goto out;
	}
	pid_t pid = fork();
	if (pid == 0) {
		sigset_t all;
		sigemptyset(&all);
		signal(SIGPIPE, SIG_DFL); /* the agent ignores it; a command gets the default, as under crun */
		sigprocmask(SIG_SETMASK, &all, NULL);
		setsid();
		int err = 0;
		if (tty) err = take_pty(slave, uid, gid);
		else { dup2(in[0], 0); dup2(o[1], 1); dup2(e[1], 2); }
		if (err) {}
		else if (chdir(cwd)) err = errno;
		else if (setgroups(0, NULL) && errno != EPERM) err = errno;
		else if (setgid(gid)) err = errno;
		else if (setuid(uid)) err = errno;
		if (!err && mode == RUN_WATCH) {
			/* no exec: nothing of the agent's may stay open in it (the port, other commands' pipes) */
			syscall(SYS_close_range, 3, ~0U, 0);
			watch_main(argv[0], argc > 1 && !strcmp(argv[1], "recursive"));
		}
		if (!err) {
			environ = envp;
			execvp(argv[0], argv);
			err = errno;
		}
		int32_t v = err;
		(void)!write(ep[1], &v, 4);
		_exit(127);
	}
	if (!tty) { close(o[1]); close(e[1]); close(in[0]); }
	close(ep[1]);
	if (pid < 0) {
		send_end(chan, errno, "exec", argv[0]);
		close(o[0]); if (e[0] >= 0) close(e[0]); close(in[1]); close(ep[0]);
		goto out;
	}
	int32_t err = 0;
	ssize_t n = read(ep[0], &err, 4); /* EOF (0): the exec succeeded */
	close(ep[0]);
	if (n == 4) {
		waitpid(pid, NULL, 0);
		close(o[0]); if (e[0] >= 0) close(e[0]); close(in[1]);
		send_end(chan, err, "exec", argv[0]);
		goto out;
	}
	nonblock(o[0]); if (e[0] >= 0) nonblock(e[0]); nonblock(in[1]);
	*slot = (struct proc){.chan = chan, .pid = pid, .out = o[0], .err = e[0], .in = in[1], .tty = tty,
			      .watch = mode == RUN_WATCH};
	unsigned char p[4];
	put32(p, (uint32_t)pid);
	send_frame(T_STARTED, chan, p, 4);
out:
	for (uint32_t i = 0; i < argc; i++) free(argv[i]);
	for (uint32_t i = 0; envp && i < envc; i++) free(envp[i]);
	free(argv); free(envp); free(cwd);
}

/* Every process of the command's session (it is its session's leader): its process group, and
 * the groups a shell on a terminal makes for its jobs, which a signal to one group misses */
static void signal_session(pid_t leader, int sig)
{
	if (kill(-leader, sig)) kill(leader, sig);
	DIR *d = opendir("/proc");
	if (!d) return;
	struct dirent *de;
	while ((de = readdir(d))) {
		pid_t pid = (pid_t)atoi(de->d_name);
		if (pid > 1 && pid != leader && getsid(pid) == leader) kill(pid, sig);
	}
	closedir(d);
}

static void close_in(struct proc *p)
{
	if (p->in >= 0) close(p->in);
	p->in = -1;
	free(p->inbuf);
	p->inbuf = NULL;
	p->inlen = 0;
}

static void flush_in(struct proc *p)
{
	while (p->in >= 0 && p->inlen) {
		ssize_t n = write(p->in, p->inbuf, p->inlen);
		if (n < 0) {
			if (errno == EAGAIN || errno == EINTR) return;
			close_in(p); /* EPIPE: the command stopped reading */
			return;
		}
		memmove(p->inbuf, p->inbuf + n, p->inlen - n);
		p->inlen -= n;
	}
	if (p->in >= 0 && !p->inlen && p->in_eof)
		close_in(p);
}

static void do_stdin(uint32_t chan, const unsigned char *data, size_t len)
{
	struct proc *p = find(chan);
	if (!p || p->in < 0) return;
	if (!len && p->tty) return; /* a terminal has no end of input: its master stays (^D is a key) */
	if (!len) { p->in_eof = 1; flush_in(p); return; }
	p->inbuf = realloc(p->inbuf, p->inlen + len);
	if (!p->inbuf) die("realloc");
	memcpy(p->inbuf + p->inlen, data, len);
	p->inlen += len;
	flush_in(p);
}

/* 0 at EOF or when the pipe is empty for now; the caller tells them apart by *eof */
static void drain(struct proc *p, int *fd, int type)
{
	static char buf[64 << 10];
	while (*fd >= 0) {
		ssize_t n = read(*fd, buf, sizeof buf);
		if (n > 0) { if (!p->orphan) send_frame(type, p->chan, buf, n); continue; }
		if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
		close(*fd);
		*fd = -1;
	}
}

static void reap(void)
{
	int status;
	pid_t pid;
	while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
		for (int i = 0; i < MAX_PROCS; i++) {
			struct proc *p = &procs[i];
			if (p->pid != pid) continue;
			/* what it wrote before exiting is all in the pipes now; a descendant that
			 * keeps them open does not hold the exit back */
			drain(p, &p->out, T_STDOUT);
			drain(p, &p->err, T_STDERR);
			if (p->out >= 0) close(p->out);
			if (p->err >= 0) close(p->err);
			close_in(p);
			unsigned char v[4];
			int32_t code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
			put32(v, (uint32_t)code);
			if (!p->orphan)
				send_frame(T_EXIT, p->chan, v, 4);
			*p = (struct proc){.pid = 0, .out = -1, .err = -1, .in = -1};
		}
	}
}

/* the payload's size, which a LIST's credit pays for */
static size_t send_stat(int type, uint32_t chan, const char *name, const struct stat *st, const char *link)
{
	size_t nl = strlen(name), ll = link ? strlen(link) : 0;
	unsigned char *b = malloc(40 + nl + ll);
	put32(b, st->st_mode); put32(b + 4, st->st_uid); put32(b + 8, st->st_gid);
	put32(b + 12, (uint32_t)((uint64_t)st->st_size >> 32)); put32(b + 16, (uint32_t)st->st_size);
	int64_t ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
	put32(b + 20, (uint32_t)((uint64_t)ns >> 32)); put32(b + 24, (uint32_t)ns);
	put32(b + 28, st->st_nlink);
	put32(b + 32, nl); memcpy(b + 36, name, nl);
	put32(b + 36 + nl, ll); if (ll) memcpy(b + 40 + nl, link, ll);
	send_frame(type, chan, b, 40 + nl + ll);
	free(b);
	return 40 + nl + ll;
}

static struct stream *find_stream(uint32_t chan)
{
	for (int i = 0; i < MAX_STREAMS; i++)
		if (streams[i].path && streams[i].chan == chan)
			return &streams[i];
	return NULL;
}

static void drop_stream(struct stream *s)
{
	if (s->fd >= 0) close(s->fd);
	if (s->dir) closedir(s->dir);
	free(s->path);
	*s = (struct stream){.fd = -1};
}

static void end_stream(struct stream *s, int err, const char *what)
{
	send_end(s->chan, err, what, s->path);
	drop_stream(s);
}

/* READ (list = 0) or LIST: the file or directory opened, answered by serve() as credit allows */
static void open_stream(uint32_t chan, const char *path, struct rd *r, int list)
{
	const char *what = list ? "list" : "read";
	int64_t credit = r->end - r->p >= 4 ? (int64_t)rd32(r) : NO_CREDIT;
	struct stream *s = NULL;
	for (int i = 0; i < MAX_STREAMS && !s; i++)
		if (!streams[i].path) s = &streams[i];
	if (!s || find_stream(chan)) { send_end(chan, s ? EEXIST : EAGAIN, what, path); return; }
	if (list) {
		DIR *d = opendir(path);
		if (!d) { send_end(chan, errno, what, path); return; }
		*s = (struct stream){.chan = chan, .fd = -1, .dir = d, .credit = credit};
	} else {
		int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
		struct stat st;
		if (fd < 0) { send_end(chan, errno, what, path); return; }
		if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
			int err = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
			close(fd);
			send_end(chan, err, what, path);
			return;
		}
		*s = (struct stream){.chan = chan, .fd = fd, .credit = credit};
	}
	s->path = strdup(path);
	if (!s->path) die("strdup");
}

/* One frame of a stream, if the host's credit for it is not spent; at its end, END */
static void serve(struct stream *s)
{
	static char buf[IO_CHUNK];
	if (s->credit <= 0) return;
	if (s->dir) {
		for (;;) {
			errno = 0;
			struct dirent *de = readdir(s->dir);
			if (!de) { end_stream(s, errno, "list"); return; }
			if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
			struct stat st;
			if (fstatat(dirfd(s->dir), de->d_name, &st, AT_SYMLINK_NOFOLLOW)) continue; /* removed meanwhile */
			char link[4096] = "";
			if (S_ISLNK(st.st_mode)) {
				ssize_t n = readlinkat(dirfd(s->dir), de->d_name, link, sizeof link - 1);
				link[n > 0 ? n : 0] = 0;
			}
			/* an entry may take the credit below zero: the host allows one frame past it */
			size_t n = send_stat(T_ENTRY, s->chan, de->d_name, &st, S_ISLNK(st.st_mode) ? link : NULL);
			if (s->credit != NO_CREDIT) s->credit -= (int64_t)n;
			return;
		}
	}
	size_t want = s->credit < (int64_t)sizeof buf ? (size_t)s->credit : sizeof buf;
	ssize_t n = read(s->fd, buf, want);
	if (n < 0 && errno == EINTR) return;
	if (n <= 0) { end_stream(s, n < 0 ? errno : 0, "read"); return; }
	send_frame(T_DATA, s->chan, buf, n);
	if (s->credit != NO_CREDIT) s->credit -= n;
}

/* -- ports: TCP connections to the guest's own 127.0.0.1, relayed for the host ------------------ */
static struct portc *find_port(uint32_t chan)
{
	for (int i = 0; i < MAX_PORTS; i++)
		if (ports[i].fd >= 0 && ports[i].chan == chan)
			return &ports[i];
	return NULL;
}

static void drop_port(struct portc *c)
{
	if (c->fd >= 0) close(c->fd);
	free(c->out);
	*c = (struct portc){.fd = -1};
}

/* END is a connection's last frame: errno 0 once both directions ended, else why it ended */
static void end_port(struct portc *c, int err)
{
	char where[32];
	snprintf(where, sizeof where, "127.0.0.1 (channel %u)", c->chan);
	send_end(c->chan, err, "connection to", where);
	drop_port(c);
}

static void do_connect(uint32_t chan, struct rd *r)
{
	uint32_t portno = rd32(r), credit = rd32(r);
	char where[32];
	snprintf(where, sizeof where, "127.0.0.1:%u", portno);
	if (r->bad) return;
	struct portc *c = NULL;
	for (int i = 0; i < MAX_PORTS && !c; i++)
		if (ports[i].fd < 0) c = &ports[i];
	if (!c || find_port(chan) || portno == 0 || portno > 65535) {
		send_end(chan, !c ? EAGAIN : portno == 0 || portno > 65535 ? EINVAL : EEXIST, "connect", where);
		return;
	}
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) { send_end(chan, errno, "connect", where); return; }
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(portno), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
	if (rc && errno != EINPROGRESS) { send_end(chan, errno, "connect", where); close(fd); return; }
	*c = (struct portc){.chan = chan, .fd = fd, .connecting = rc != 0, .credit = credit};
	if (!rc) send_frame(T_OPENED, chan, NULL, 0);
}

/* the host's bytes into the socket, as far as it takes them; what it took is the host's credit back */
static void flush_port(struct portc *c)
{
	size_t done = 0;
	while (done < c->outlen) {
		ssize_t n = write(c->fd, c->out + done, c->outlen - done);
		if (n < 0 && errno == EINTR) continue;
		if (n < 0 && errno == EAGAIN) break;
		if (n < 0) { end_port(c, errno); return; }
		done += n;
	}
	if (done) {
		unsigned char v[4];
		memmove(c->out, c->out + done, c->outlen - done);
		c->outlen -= done;
		put32(v, (uint32_t)done);
		send_frame(T_MORE, c->chan, v, 4);
	}
	if (!c->outlen && c->wr_eof && !c->shut) {
		shutdown(c->fd, SHUT_WR);
		c->shut = 1;
	}
	if (c->shut && c->rd_eof) end_port(c, 0);
}

/* the socket's bytes to the host while it has credit; at its end SHUT */
static void pump_port(struct portc *c)
{
	static char buf[IO_CHUNK];
	while (c->credit > 0) {
		size_t want = c->credit < (int64_t)sizeof buf ? (size_t)c->credit : sizeof buf;
		ssize_t n = read(c->fd, buf, want);
		if (n < 0 && errno == EINTR) continue;
		if (n < 0 && errno == EAGAIN) return;
		if (n < 0) { end_port(c, errno); return; }
		if (n == 0) {
			c->rd_eof = 1;
			send_frame(T_SHUT, c->chan, NULL, 0);
			if (c->shut) end_port(c, 0);
			return;
		}
		send_frame(T_DATA, c->chan, buf, n);
		c->credit -= n;
	}
}

static void connected(struct portc *c)
{
	int err = 0;
	socklen_t len = sizeof err;
	if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len)) err = errno;
	if (err) { end_port(c, err); return; }
	c->connecting = 0;
	send_frame(T_OPENED, c->chan, NULL, 0);
}

/* A frame of the host's on a connection: DATA for the socket, END (its end of input), MORE
 * (credit), CLOSE (it wants nothing more: the connection is dropped, END answers) */
static void port_frame(struct portc *c, int type, const unsigned char *pl, size_t len)
{
	struct rd r = {pl, pl + len, 0};
	switch (type) {
	case T_DATA:
		if (c->wr_eof || !len) break;
		c->out = realloc(c->out, c->outlen + len);
		if (!c->out) die("realloc");
		memcpy(c->out + c->outlen, pl, len);
		c->outlen += len;
		if (!c->connecting) flush_port(c);
		break;
	case T_END: c->wr_eof = 1; if (!c->connecting) flush_port(c); break;
	case T_MORE: { uint32_t a = rd32(&r); if (!r.bad) c->credit += a; break; }
	default: end_port(c, ECONNABORTED); /* T_CLOSE */
	}
}

/* A new host connection: what an earlier one asked for is nobody's now.  Its streams and port
 * connections are dropped, its upload abandoned, its watches killed (their events were for it
 * alone), its commands run on with their output and exit unsent, so the new host never reads
 * an answer to a request it did not make.  The answer starts with the host's token: whatever
 * came before it on the port is the earlier connection's. */
static void hello(uint32_t chan, const unsigned char *token, size_t len)
{
	for (int i = 0; i < MAX_STREAMS; i++)
		if (streams[i].path) drop_stream(&streams[i]);
	for (int i = 0; i < MAX_PROCS; i++)
		if (procs[i].pid > 0 && !procs[i].orphan) {
			procs[i].orphan = 1;
			close_in(&procs[i]);
			if (procs[i].watch) kill(procs[i].pid, SIGKILL); /* its events are for no one now */
		}
	if (writing >= 0) { close(writing); writing = -1; unlink(writing_tmp); }
	for (int i = 0; i < MAX_PORTS; i++)
		if (ports[i].fd >= 0) drop_port(&ports[i]);
	unsigned char out[TOKEN + sizeof AGENT_VERSION];
	size_t n = len < TOKEN ? len : TOKEN;
	memcpy(out, token, n);
	memcpy(out + n, AGENT_VERSION, strlen(AGENT_VERSION));
	send_frame(T_HELLO, chan, out, n + strlen(AGENT_VERSION));
}

static void do_write_open(uint32_t chan, uint32_t mode, const char *path)
{
	if (writing >= 0) { send_end(chan, EBUSY, "write", path); return; }
	/* into a temporary beside it, renamed at the end: an interrupted upload leaves the old file */
	snprintf(writing_path, sizeof writing_path, "%s", path);
	snprintf(writing_tmp, sizeof writing_tmp, "%s.lb-upload-%u", path, chan);
	struct stat st;
	if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) { send_end(chan, EISDIR, "write", path); return; }
	writing = open(writing_tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode & 07777);
	if (writing < 0) { send_end(chan, errno, "write", path); return; }
	fchmod(writing, mode & 07777);
	writing_chan = chan;
}

static void do_write_data(uint32_t chan, const unsigned char *data, size_t len, int end)
{
	if (writing < 0 || chan != writing_chan) return; /* already failed and answered */
	while (len) {
		ssize_t n = write(writing, data, len);
		if (n < 0 && errno == EINTR) continue;
		if (n < 0) {
			int err = errno;
			close(writing); writing = -1; unlink(writing_tmp);
			send_end(chan, err, "write", writing_path);
			return;
		}
		data += n; len -= n;
	}
	if (!end) return;
	int err = 0;
	if (close(writing)) err = errno;
	writing = -1;
	if (!err && rename(writing_tmp, writing_path)) err = errno;
	if (err) unlink(writing_tmp);
	send_end(chan, err, "write", writing_path);
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f)
{
	(void)st; (void)f;
	return flag == FTW_DP ? rmdir(p) : unlink(p);
}

static void do_remove(uint32_t chan, uint32_t recursive, const char *path)
{
	struct stat st;
	int err = 0;
	if (lstat(path, &st)) err = errno;
	else if (S_ISDIR(st.st_mode)) {
		if (recursive) { if (nftw(path, rm_one, 64, FTW_DEPTH | FTW_PHYS | FTW_MOUNT)) err = errno; }
		else if (rmdir(path)) err = errno;
	} else if (unlink(path)) err = errno;
	send_end(chan, err, "remove", path);
}

/* the /dev node of the virtio disk whose serial is `want`, or "" */
static void disk_by_serial(const char *want, char *out, size_t n)
{
	out[0] = 0;
	DIR *d = opendir("/sys/block");
	if (!d) return;
	struct dirent *de;
	while ((de = readdir(d))) {
		if (strncmp(de->d_name, "vd", 2)) continue;
		char p[300], serial[64] = "";
		snprintf(p, sizeof p, "/sys/block/%s/serial", de->d_name);
		int fd = open(p, O_RDONLY | O_CLOEXEC);
		if (fd < 0) continue;
		ssize_t r = read(fd, serial, sizeof serial - 1);
		close(fd);
		serial[r > 0 ? r : 0] = 0;
		serial[strcspn(serial, "\n")] = 0;
		if (!strcmp(serial, want)) { snprintf(out, n, "/dev/%s", de->d_name); break; }
	}
	closedir(d);
}

static int mount_err(uint32_t chan, const char *what, const char *path)
{
	send_end(chan, errno ? errno : EIO, what, path);
	return -1;
}

/* The sandbox's disk and root, once, with mount(2) rather than a script: under TCG every
 * process a shell starts costs tens of ms (docs/FORMAT.md Part 5, "The guest"). */
/* Every VM restored from one template starts with the template's kernel RNG state: without
 * fresh bytes credited and a forced reseed, two sandboxes' /dev/urandom (and every seed taken
 * from it) agree byte for byte until the kernel's next periodic reseed. */
static int reseed(const unsigned char *seed, size_t len)
{
	struct { int entropy_count; int buf_size; unsigned char buf[256]; } e;
	if (len < 32 || len > sizeof e.buf) { errno = EINVAL; return -1; }
	int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
	if (fd < 0) return -1;
	e.entropy_count = (int)(len * 8);
	e.buf_size = (int)len;
	memcpy(e.buf, seed, len);
	int rc = ioctl(fd, RNDADDENTROPY, &e);
	if (!rc) rc = ioctl(fd, RNDRESEEDCRNG);
	int saved = errno;
	explicit_bzero(&e, sizeof e);
	close(fd);
	errno = saved;
	return rc;
}

static void do_mount(uint32_t chan, const unsigned char *seed, size_t len)
{
	/* every MOUNT, a resumed guest's too: the host sends fresh bytes each time */
	if (reseed(seed, len)) { mount_err(chan, "reseed", "/dev/urandom"); return; }
	if (mounted) { send_end(chan, 0, "mount", root_dir); return; }
	char dev[300], lowers[4096], opts[4200], sub[4200];
	disk_by_serial("lb-upper", dev, sizeof dev);
	if (!dev[0]) { errno = ENODEV; mount_err(chan, "mount", "(no disk with serial lb-upper)"); return; }
	int fd = open("/lowers", O_RDONLY | O_CLOEXEC);
	ssize_t n = fd >= 0 ? read(fd, lowers, sizeof lowers - 1) : -1;
	if (fd >= 0) close(fd);
	if (n <= 0) { mount_err(chan, "read", "/lowers"); return; }
	lowers[n] = 0;
	lowers[strcspn(lowers, "\n")] = 0;
	/* noinit_itable: no background zeroing of inode tables, which would take the guest's vCPU */
	if (mount(dev, "/disk", "ext4", MS_NOATIME, "noinit_itable")) { mount_err(chan, "mount ext4", dev); return; }
	mkdir("/disk/upper", 0755);
	mkdir("/disk/work", 0755);
	snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=/disk/upper,workdir=/disk/work", lowers);
	if (mount("overlay", root_dir, "overlay", 0, opts)) { mount_err(chan, "mount overlay", root_dir); return; }
	static const struct { const char *src, *dir, *type, *data; unsigned long flags; } m[] = {
		{"proc", "proc", "proc", "", MS_NOSUID | MS_NODEV | MS_NOEXEC},
		{"sys", "sys", "sysfs", "", MS_NOSUID | MS_NODEV | MS_NOEXEC},
		{"dev", "dev", "devtmpfs", "", MS_NOSUID},
		{"devpts", "dev/pts", "devpts", "newinstance,ptmxmode=0666", MS_NOSUID | MS_NOEXEC},
		{"shm", "dev/shm", "tmpfs", "mode=1777", MS_NOSUID | MS_NODEV},
	};
	for (size_t i = 0; i < sizeof m / sizeof m[0]; i++) {
		snprintf(sub, sizeof sub, "%s/%s", root_dir, m[i].dir);
		mkdir(sub, 0755);
		if (mount(m[i].src, sub, m[i].type, m[i].flags, m[i].data)) { mount_err(chan, "mount", sub); return; }
	}
	if (chroot(root_dir) || chdir("/")) { mount_err(chan, "chroot", root_dir); return; }
	mounted = 1;
	send_end(chan, 0, "mount", root_dir);
}

/* eth0's address and default route (the sandbox's namespace routes and polices the rest) */
static void do_net(uint32_t chan, uint32_t addr, uint32_t prefix, uint32_t gw)
{
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (s < 0) { send_end(chan, errno, "socket", "eth0"); return; }
	struct ifreq ifr;
	memset(&ifr, 0, sizeof ifr);
	snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "eth0");
	struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
	sin->sin_family = AF_INET;
	sin->sin_addr.s_addr = htonl(addr);
	int err = 0;
	const char *step = "";
	if (ioctl(s, SIOCSIFADDR, &ifr)) { err = errno; step = "address"; }
	sin->sin_addr.s_addr = htonl(prefix ? ~0u << (32 - prefix) : 0);
	if (!err && ioctl(s, SIOCSIFNETMASK, &ifr)) { err = errno; step = "netmask"; }
	if (!err && ioctl(s, SIOCGIFFLAGS, &ifr)) { err = errno; step = "flags"; }
	ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
	if (!err && ioctl(s, SIOCSIFFLAGS, &ifr)) { err = errno; step = "up"; }
	if (!err && gw) {
		struct rtentry rt;
		memset(&rt, 0, sizeof rt);
		((struct sockaddr_in *)&rt.rt_dst)->sin_family = AF_INET;
		((struct sockaddr_in *)&rt.rt_genmask)->sin_family = AF_INET;
		struct sockaddr_in *g = (struct sockaddr_in *)&rt.rt_gateway;
		g->sin_family = AF_INET;
		g->sin_addr.s_addr = htonl(gw);
		rt.rt_flags = RTF_UP | RTF_GATEWAY;
		rt.rt_dev = ifr.ifr_name;
		if (ioctl(s, SIOCADDRT, &rt) && errno != EEXIST) { err = errno; step = "default route"; }
	}
	close(s);
	send_end(chan, err, step, "eth0");
}

static void handle(int type, uint32_t chan, const unsigned char *pl, size_t len)
{
	struct rd r = {pl, pl + len, 0};
	char *path = NULL;
	uint32_t a;
	struct portc *conn = find_port(chan);
	if (conn && (type == T_DATA || type == T_END || type == T_MORE || type == T_CLOSE)) {
		port_frame(conn, type, pl, len);
		return;
	}
	if (type == T_CLOSE) return; /* a connection that ended meanwhile: its END is on its way */
	if (!mounted && type != T_PING && type != T_MOUNT && type != T_SYNC && type != T_STDIN && type != T_SIGNAL
	    && type != T_NET && type != T_HELLO) {
		send_end(chan, EAGAIN, "request", "(the sandbox's disk is not mounted yet)");
		return;
	}
	switch (type) {
	case T_MOUNT: do_mount(chan, pl, len); break;
	case T_NET: {
		uint32_t addr = rd32(&r), prefix = rd32(&r), gw = rd32(&r);
		if (!r.bad) do_net(chan, addr, prefix > 32 ? 32 : prefix, gw);
		break;
	}
	case T_PING: send_frame(T_PONG, chan, pl, len); break;
	case T_HELLO: hello(chan, pl, len); break;
	case T_EXEC: do_exec(chan, &r, RUN_EXEC); break;
	case T_PTY: do_exec(chan, &r, RUN_PTY); break;
	case T_WATCH: do_exec(chan, &r, RUN_WATCH); break;
	case T_RESIZE: {
		struct proc *p = find(chan);
		uint32_t cols = rd32(&r), rows = rd32(&r);
		struct winsize ws = {.ws_row = rows, .ws_col = cols};
		/* the kernel signals the terminal's foreground process group (SIGWINCH) */
		if (p && p->tty && !r.bad) ioctl(p->in >= 0 ? p->in : p->out, TIOCSWINSZ, &ws);
		break;
	}
	case T_CONNECT: do_connect(chan, &r); break;
	case T_STDIN: do_stdin(chan, pl, len); break;
	case T_SIGNAL: {
		struct proc *p = find(chan);
		a = rd32(&r);
		if (p && !r.bad) signal_session(p->pid, (int)a);
		break;
	}
	case T_READ: if ((path = rdstr(&r))) open_stream(chan, path, &r, 0); break;
	case T_LIST: if ((path = rdstr(&r))) open_stream(chan, path, &r, 1); break;
	case T_MORE: {
		struct stream *s = find_stream(chan);
		a = rd32(&r);
		/* a stream that ended meanwhile: nothing to answer */
		if (s && !r.bad && s->credit != NO_CREDIT) s->credit += a;
		break;
	}
	case T_WRITE: a = rd32(&r); if ((path = rdstr(&r))) do_write_open(chan, a, path); break;
	case T_DATA: do_write_data(chan, pl, len, 0); break;
	case T_END: {
		/* on a stream: the host wants no more of it (ended meanwhile: nothing to answer) */
		struct stream *s = find_stream(chan);
		if (s) end_stream(s, ECANCELED, s->dir ? "list" : "read");
		else do_write_data(chan, pl, 0, 1);
		break;
	}
	case T_STAT:
		if ((path = rdstr(&r))) {
			struct stat st;
			if (lstat(path, &st)) send_end(chan, errno, "stat", path);
			else { send_stat(T_ENTRY, chan, path, &st, NULL); send_end(chan, 0, "stat", path); }
		}
		break;
	case T_REMOVE: a = rd32(&r); if ((path = rdstr(&r))) do_remove(chan, a, path); break;
	case T_MKDIR:
		a = rd32(&r);
		if ((path = rdstr(&r))) send_end(chan, mkdir(path, a & 07777) ? errno : 0, "mkdir", path);
		break;
	case T_SYNC: sync(); send_end(chan, 0, "sync", "/"); break;
	default: send_end(chan, ENOSYS, "frame", "(unknown type)");
	}
	if (r.bad) send_end(chan, EINVAL, "frame", "(short payload)");
	free(path);
}

/* A value of /proc/meminfo in kB (-1 when absent). */
static long meminfo_kb(const char *field)
{
	FILE *f = fopen("/proc/meminfo", "re");
	if (!f) return -1;
	char line[128];
	long v = -1;
	size_t n = strlen(field);
	while (fgets(line, sizeof line, f))
		if (!strncmp(line, field, n) && line[n] == ':') { v = strtol(line + n + 1, NULL, 10); break; }
	fclose(f);
	return v;
}

/* The pages the allocator keeps from user allocations, as the kernel counts them for MemAvailable
 * (calculate_totalreserve_pages): per zone its high watermark plus its largest lowmem_reserve. */
static long reserve_pages(void)
{
	FILE *f = fopen("/proc/zoneinfo", "re");
	if (!f) return -1;
	char line[512];
	long total = 0, high = 0, managed = 0, v;
	while (fgets(line, sizeof line, f)) {
		if (sscanf(line, " high %ld", &v) == 1) high = v;
		else if (sscanf(line, " managed %ld", &v) == 1) managed = v;
		else if (strstr(line, "protection: (")) {
			long most = 0;
			for (char *q = strchr(line, '(') + 1; *q && *q != ')'; q++) {
				v = strtol(q, &q, 10);
				if (v > most) most = v;
				if (*q == ')') break;
			}
			total += high + most < managed ? high + most : managed;
		}
	}
	fclose(f);
	return total;
}

/* Before the template is saved: the free pages the boot dirtied, zeroed.  The pages the kernel
 * freed after boot (the kernel's decompression buffers, init sections, the initramfs archive,
 * early allocations) keep their bytes, and a restored guest allocates from them first: each
 * would be a fetch from the store on a host that maps the template lazily.  Zeroed, they are
 * holes of the published memory file and cost nothing to read.  The kernel zeroes an
 * anonymous page it faults in (MAP_POPULATE); unmapping hands it back, still zero.
 *
 * SCRUB_KB of them, not all free memory: the allocator hands out the pages freed last first,
 * and the memory the kernel never touched (freed to the lists' tails at boot) is zero
 * already -- faulting it in too only made the template's memory file as big as the guest's
 * RAM on the host's disk and cost TCG a second per 100 MiB (docs/FORMAT.md Part 5 has the
 * measurement).  And never below what the kernel keeps for itself, checked before every
 * chunk: the agent is PID 1, the one process, so an allocation the kernel cannot satisfy is
 * not an OOM kill but a panic ("System is deadlocked on memory": what a fixed 24 MiB margin
 * did at 1 GiB, where transparent hugepages raise min_free_kbytes to 44 MiB).  That is the
 * zones' high watermarks and lowmem reserves, plus page tables and per-CPU lists. */
#define SCRUB_KB (64L << 10)
#define SCRUB_STEP (4u << 20)
static void scrub_free_memory(void)
{
	int fd = open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
	if (fd >= 0) { if (write(fd, "3", 1) < 0) {} close(fd); }
	long total_kb = meminfo_kb("MemTotal"), reserved = reserve_pages();
	if (total_kb <= 0 || reserved < 0) return; /* nothing to bound it by: no scrub */
	long keep_kb = reserved * (getpagesize() / 1024) + 4096 + total_kb / 256;
	void *chain = NULL;
	for (long done = 0; done < SCRUB_KB; done += SCRUB_STEP / 1024) {
		if (meminfo_kb("MemFree") - (long)(SCRUB_STEP / 1024) < keep_kb) break;
		void *p = mmap(NULL, SCRUB_STEP, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
		if (p == MAP_FAILED) break;
		*(void **)p = chain; /* each chunk names the one before */
		chain = p;
	}
	while (chain) { void *next = *(void **)chain; munmap(chain, SCRUB_STEP); chain = next; }
}

int main(int argc, char **argv)
{
	if (argc != 3) { fprintf(stderr, "usage: lb-agent PORT ROOT\n"); return 2; }
	root_dir = argv[2];
	for (int i = 0; i < MAX_PROCS; i++) procs[i] = (struct proc){.out = -1, .err = -1, .in = -1};
	for (int i = 0; i < MAX_STREAMS; i++) streams[i] = (struct stream){.fd = -1};
	for (int i = 0; i < MAX_PORTS; i++) ports[i] = (struct portc){.fd = -1};
	port = open(argv[1], O_RDWR | O_CLOEXEC);
	if (port < 0) die(argv[1]);
	signal(SIGPIPE, SIG_IGN);
	/* SIGIO when the host connects to the port (virtio_console's PORT_OPEN) or sends: with no
	 * host connected the port polls readable and hung up, always, and reads nothing, so the
	 * loop waits for the signal then instead of waking every few ms (7-8% of a core under TCG
	 * for an idle guest) */
	if (fcntl(port, F_SETOWN, getpid()) == 0) /* without it, the loop looks again each second */
		fcntl(port, F_SETFL, fcntl(port, F_GETFL) | O_ASYNC);
	sigset_t mask;
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigaddset(&mask, SIGIO);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	int sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
	if (sfd < 0) die("signalfd");
	scrub_free_memory(); /* the agent starts only in a template's boot: every VM restores one */
	send_frame(T_READY, 0, AGENT_VERSION, strlen(AGENT_VERSION));

	size_t cap = MAX_FRAME + 16, have = 0;
	unsigned char *buf = malloc(cap);
	int hangup = 0; /* the port's last poll said no host: leave it out until a signal or a second */
	struct pollfd pf[2 + 3 * MAX_PROCS + MAX_PORTS];
	struct proc *owner[2 + 3 * MAX_PROCS + MAX_PORTS];
	struct portc *conn[2 + 3 * MAX_PROCS + MAX_PORTS];
	int kind[2 + 3 * MAX_PROCS + MAX_PORTS];
	for (;;) {
		int n = 0;
		pf[n++] = (struct pollfd){hangup ? -1 : port, POLLIN, 0};
		pf[n++] = (struct pollfd){sfd, POLLIN, 0};
		for (int i = 0; i < MAX_PROCS; i++) {
			struct proc *p = &procs[i];
			if (p->pid <= 0) continue;
			if (p->out >= 0) { owner[n] = p; kind[n] = 1; pf[n++] = (struct pollfd){p->out, POLLIN, 0}; }
			if (p->err >= 0) { owner[n] = p; kind[n] = 2; pf[n++] = (struct pollfd){p->err, POLLIN, 0}; }
			if (p->in >= 0 && p->inlen) { owner[n] = p; kind[n] = 3; pf[n++] = (struct pollfd){p->in, POLLOUT, 0}; }
		}
		for (int i = 0; i < MAX_PORTS; i++) {
			struct portc *c = &ports[i];
			short ev = c->fd < 0 ? 0 : c->connecting ? POLLOUT
				: (short)((!c->rd_eof && c->credit > 0 ? POLLIN : 0) | (c->outlen ? POLLOUT : 0));
			/* none wanted: not polled, or a socket's hangup would wake the loop until credit comes */
			if (ev) { conn[n] = c; kind[n] = 4; pf[n++] = (struct pollfd){c->fd, ev, 0}; }
		}
		int ready = 0; /* a stream with credit left: look at the fds, then serve it */
		for (int i = 0; i < MAX_STREAMS; i++)
			if (streams[i].path && streams[i].credit > 0) ready = 1;
		if (poll(pf, n, ready ? 0 : hangup ? 1000 : -1) < 0) { if (errno == EINTR) continue; die("poll"); }
		hangup = 0; /* woken: look at the port again */
		for (int i = 2; i < n; i++) {
			if (!pf[i].revents) continue;
			struct proc *p = owner[i];
			if (kind[i] == 4) {
				struct portc *c = conn[i];
				/* an earlier event of this turn (a hello) may have dropped it */
				if (c->fd != pf[i].fd) continue;
				if (c->connecting) { connected(c); continue; }
				if (c->outlen && (pf[i].revents & (POLLOUT | POLLERR | POLLHUP))) flush_port(c);
				if (c->fd == pf[i].fd && !c->rd_eof && (pf[i].revents & (POLLIN | POLLERR | POLLHUP))) pump_port(c);
				continue;
			}
			if (kind[i] == 1) drain(p, &p->out, T_STDOUT);
			else if (kind[i] == 2) drain(p, &p->err, T_STDERR);
			else flush_in(p);
		}
		if (pf[1].revents) {
			struct signalfd_siginfo si;
			while (read(sfd, &si, sizeof si) == sizeof si) {}
			reap();
		}
		if (pf[0].revents & POLLIN) {
			ssize_t got = read(port, buf + have, cap - have);
			/* nothing to read and no host: the port polls readable and hung up then */
			if (got <= 0) { hangup = 1; continue; }
			have += got;
			size_t off = 0;
			while (have - off >= 9) {
				uint32_t len = get32(buf + off);
				if (len < 5 || len > MAX_FRAME + 5) { have = off = 0; break; } /* lost sync: drop */
				if (have - off < 4 + len) break;
				handle(buf[off + 4], get32(buf + off + 5), buf + off + 9, len - 5);
				off += 4 + len;
			}
			memmove(buf, buf + off, have - off);
			have -= off;
		} else if (pf[0].revents & (POLLHUP | POLLERR)) {
			hangup = 1; /* no host connected (between a save and its restore, or none holds one) */
		}
		for (int i = 0; i < MAX_STREAMS; i++)
			if (streams[i].path) serve(&streams[i]);
	}
}
