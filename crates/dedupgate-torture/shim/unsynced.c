/* unsynced.c: an LD_PRELOAD recorder for the never-synced-write loss fault of
 * dedupgate-torture (src/storage_faults.rs). It changes nothing the process sees: it only
 * appends one line per durability-relevant event on a file under DEDUPGATE_SHIM_ROOT to
 * DEDUPGATE_SHIM_LOG (O_APPEND, one write(2) per line, so a SIGKILL never tears a line):
 *
 *   W <offset> <len> <ino> <path>   a write of <len> bytes at <offset> succeeded (not yet durable)
 *   S <size> <ino> <path>   fsync/fdatasync of a regular file succeeded; <size> bytes are durable
 *   D <path>             fsync of a directory succeeded; its entries are durable
 *   C <ino> <path>       open(O_CREAT) created a file that did not exist
 *   R <from>\t<to>       rename succeeded
 *   U <path>             unlink succeeded
 *   F <call> <errno> <ino> <path>   write/pwrite/writev/fsync/fdatasync failed (an injected
 *                        fault, when fiu sits behind this library in LD_PRELOAD)
 *
 * <ino> is the file's inode number (0 if fstat failed). Renames and unlinks made by raw system
 * calls (rustix, which tempfile uses, does not go through libc) never reach this library; the
 * inode lets the harness see that a path now names a file it knew under another name.
 *
 * It also narrows a fault injector loaded after it (fiu's posix preload): a write, pwrite,
 * writev, fsync or fdatasync on a file under the root goes to the next library in LD_PRELOAD
 * order (fiu, which may fail it); any other descriptor goes straight to libc. Without this,
 * fiu fails tokio's eventfd wake-up writes too, and tokio aborts the process: an artefact of
 * process-wide injection, not a disk fault.
 *
 * DEDUPGATE_SHIM_SYNC_DELAY_US, when set, sleeps that long before each sync of a file under
 * the root (a slow disk): written-but-unsynced data then sits in the page cache long enough
 * for a SIGKILL to land there often.
 *
 * After a SIGKILL the harness replays the log to cut every file back to what was synced
 * (see storage_faults.rs). Built by the harness with `cc -shared -fPIC -O2 ... -ldl`.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* Paths are bounded by PATH_MAX; a longer one is cut, which only makes it miss the root. */
#pragma GCC diagnostic ignored "-Wformat-truncation"

static int log_fd = -2;
static useconds_t sync_delay_us;
static char root[PATH_MAX];
static size_t root_len;

static ssize_t (*real_write)(int, const void *, size_t);
static void *libc_handle;

/* libc's own symbol, past every preloaded library. */
static void *libc_sym(const char *name) {
    if (!libc_handle) libc_handle = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    return libc_handle ? dlsym(libc_handle, name) : dlsym(RTLD_NEXT, name);
}

static void init(void) {
    if (log_fd != -2) return;
    real_write = libc_sym("write");
    const char *r = getenv("DEDUPGATE_SHIM_ROOT");
    const char *l = getenv("DEDUPGATE_SHIM_LOG");
    const char *delay = getenv("DEDUPGATE_SHIM_SYNC_DELAY_US");
    if (delay) sync_delay_us = (useconds_t)atol(delay);
    if (!r || !l) { log_fd = -1; return; }
    snprintf(root, sizeof root, "%s", r);
    root_len = strlen(root);
    int (*real_open)(const char *, int, ...) = dlsym(RTLD_NEXT, "open");
    log_fd = real_open(l, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
}

static int under_root(const char *p) {
    return root_len > 0 && strncmp(p, root, root_len) == 0 &&
           (p[root_len] == '/' || p[root_len] == 0);
}

static void emit(const char *fmt, ...) {
    char line[3 * PATH_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0 && log_fd >= 0) {
        int saved = errno;
        (void)real_write(log_fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        errno = saved;
    }
}

/* The absolute path of fd, when it is under the root. */
static int fd_path(int fd, char *out) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, PATH_MAX - 1);
    if (n <= 0) return 0;
    out[n] = 0;
    return under_root(out);
}

/* An absolute path for a name relative to dirfd, without requiring the name to exist. */
static int abs_path(int dirfd, const char *name, char *out) {
    char base[PATH_MAX];
    if (name[0] == '/') {
        snprintf(base, sizeof base, "%s", name);
    } else {
        char dir[PATH_MAX];
        if (dirfd == AT_FDCWD) {
            if (!getcwd(dir, sizeof dir)) return 0;
        } else {
            char link[64];
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
            ssize_t n = readlink(link, dir, sizeof dir - 1);
            if (n <= 0) return 0;
            dir[n] = 0;
        }
        snprintf(base, sizeof base, "%s/%s", dir, name);
    }
    /* Resolve the parent (it exists), keep the last component as is. */
    char *slash = strrchr(base, '/');
    if (!slash) return 0;
    char parent[PATH_MAX], resolved[PATH_MAX];
    size_t plen = (size_t)(slash - base);
    if (plen == 0) { parent[0] = '/'; parent[1] = 0; }
    else { memcpy(parent, base, plen); parent[plen] = 0; }
    if (!realpath(parent, resolved)) return 0;
    snprintf(out, PATH_MAX, "%s/%s", strcmp(resolved, "/") ? resolved : "", slash + 1);
    return under_root(out);
}

/* The next library's function for a file under the root, libc's for anything else. */
static void *pick(int fd, void **next, void **libc, const char *name) {
    char p[PATH_MAX];
    init();
    if (!*next) *next = dlsym(RTLD_NEXT, name);
    if (!*libc) *libc = libc_sym(name);
    return (log_fd >= 0 && fd_path(fd, p)) ? *next : *libc;
}

/* The inode of fd, 0 when unknown. */
static unsigned long long fd_ino(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

static void after_sync(int fd, int rc, const char *call) {
    char p[PATH_MAX];
    init();
    if (log_fd < 0) return;
    int saved = errno;
    if (!fd_path(fd, p)) { errno = saved; return; }
    if (rc != 0) {
        emit("F %s %d %llu %s\n", call, saved, fd_ino(fd), p);
    } else {
        struct stat st;
        if (fstat(fd, &st) == 0) {
            if (S_ISDIR(st.st_mode)) emit("D %s\n", p);
            else if (S_ISREG(st.st_mode))
                emit("S %lld %llu %s\n", (long long)st.st_size, (unsigned long long)st.st_ino, p);
        }
    }
    errno = saved;
}

/* off < 0: the write went to the file offset, which now sits just past it. */
static void after_write(int fd, ssize_t rc, long long off, const char *call) {
    char p[PATH_MAX];
    init();
    if (log_fd < 0 || fd == log_fd) return;
    int saved = errno;
    if (rc < 0) {
        if (saved != EAGAIN && saved != EINTR && fd_path(fd, p))
            emit("F %s %d %llu %s\n", call, saved, fd_ino(fd), p);
    } else if (rc > 0 && fd_path(fd, p)) {
        if (off < 0) off = (long long)lseek(fd, 0, SEEK_CUR) - rc;
        emit("W %lld %lld %llu %s\n", off, (long long)rc, fd_ino(fd), p);
    }
    errno = saved;
}

int fsync(int fd) {
    static void *next, *libc;
    int (*real)(int) = pick(fd, &next, &libc, "fsync");
    if (sync_delay_us && real == next) usleep(sync_delay_us);
    int rc = real(fd);
    after_sync(fd, rc, "fsync");
    return rc;
}

int fdatasync(int fd) {
    static void *next, *libc;
    int (*real)(int) = pick(fd, &next, &libc, "fdatasync");
    if (sync_delay_us && real == next) usleep(sync_delay_us);
    int rc = real(fd);
    after_sync(fd, rc, "fdatasync");
    return rc;
}

ssize_t write(int fd, const void *buf, size_t n) {
    static void *next, *libc;
    ssize_t (*real)(int, const void *, size_t) = pick(fd, &next, &libc, "write");
    ssize_t rc = real(fd, buf, n);
    after_write(fd, rc, -1, "write");
    return rc;
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
    static void *next, *libc;
    ssize_t (*real)(int, const void *, size_t, off_t) = pick(fd, &next, &libc, "pwrite64");
    ssize_t rc = real(fd, buf, n, off);
    after_write(fd, rc, (long long)off, "pwrite");
    return rc;
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    static void *next, *libc;
    ssize_t (*real)(int, const void *, size_t, off_t) = pick(fd, &next, &libc, "pwrite");
    ssize_t rc = real(fd, buf, n, off);
    after_write(fd, rc, (long long)off, "pwrite");
    return rc;
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    static void *next, *libc;
    ssize_t (*real)(int, const struct iovec *, int) = pick(fd, &next, &libc, "writev");
    ssize_t rc = real(fd, iov, cnt);
    after_write(fd, rc, -1, "writev");
    return rc;
}

static int do_open(int dirfd, const char *path, int flags, mode_t mode, int at, int is64) {
    char p[PATH_MAX];
    init();
    int tracked = log_fd >= 0 && (flags & O_CREAT) && abs_path(dirfd, path, p);
    int existed = 0;
    if (tracked) {
        struct stat st;
        existed = stat(p, &st) == 0;
    }
    int rc;
    if (at) {
        static int (*real_at)(int, const char *, int, ...), (*real_at64)(int, const char *, int, ...);
        if (!real_at) real_at = dlsym(RTLD_NEXT, "openat");
        if (!real_at64) real_at64 = dlsym(RTLD_NEXT, "openat64");
        rc = (is64 ? real_at64 : real_at)(dirfd, path, flags, mode);
    } else {
        static int (*real_o)(const char *, int, ...), (*real_o64)(const char *, int, ...);
        if (!real_o) real_o = dlsym(RTLD_NEXT, "open");
        if (!real_o64) real_o64 = dlsym(RTLD_NEXT, "open64");
        rc = (is64 ? real_o64 : real_o)(path, flags, mode);
    }
    if (tracked && rc >= 0 && !existed) {
        int saved = errno;
        emit("C %llu %s\n", fd_ino(rc), p);
        errno = saved;
    }
    return rc;
}

#define MODE_ARG(flags) \
    mode_t mode = 0; \
    if ((flags) & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }

int open(const char *path, int flags, ...) { MODE_ARG(flags); return do_open(AT_FDCWD, path, flags, mode, 0, 0); }
int open64(const char *path, int flags, ...) { MODE_ARG(flags); return do_open(AT_FDCWD, path, flags, mode, 0, 1); }
int openat(int d, const char *path, int flags, ...) { MODE_ARG(flags); return do_open(d, path, flags, mode, 1, 0); }
int openat64(int d, const char *path, int flags, ...) { MODE_ARG(flags); return do_open(d, path, flags, mode, 1, 1); }

static void after_rename(int fd1, const char *a, int fd2, const char *b, int rc) {
    if (rc != 0) return;
    init();
    if (log_fd < 0) return;
    int saved = errno;
    char pa[PATH_MAX], pb[PATH_MAX];
    int ia = abs_path(fd1, a, pa), ib = abs_path(fd2, b, pb);
    if (ia || ib) emit("R %s\t%s\n", pa, pb);
    errno = saved;
}

int rename(const char *a, const char *b) {
    static int (*real)(const char *, const char *);
    if (!real) real = dlsym(RTLD_NEXT, "rename");
    int rc = real(a, b);
    after_rename(AT_FDCWD, a, AT_FDCWD, b, rc);
    return rc;
}

int renameat(int fa, const char *a, int fb, const char *b) {
    static int (*real)(int, const char *, int, const char *);
    if (!real) real = dlsym(RTLD_NEXT, "renameat");
    int rc = real(fa, a, fb, b);
    after_rename(fa, a, fb, b, rc);
    return rc;
}

int renameat2(int fa, const char *a, int fb, const char *b, unsigned int flags) {
    static int (*real)(int, const char *, int, const char *, unsigned int);
    if (!real) real = dlsym(RTLD_NEXT, "renameat2");
    int rc = real(fa, a, fb, b, flags);
    after_rename(fa, a, fb, b, rc);
    return rc;
}

static void after_unlink(int d, const char *p, int rc) {
    if (rc != 0) return;
    init();
    if (log_fd < 0) return;
    int saved = errno;
    char ap[PATH_MAX];
    if (abs_path(d, p, ap)) emit("U %s\n", ap);
    errno = saved;
}

int unlink(const char *p) {
    static int (*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "unlink");
    int rc = real(p);
    after_unlink(AT_FDCWD, p, rc);
    return rc;
}

int unlinkat(int d, const char *p, int flags) {
    static int (*real)(int, const char *, int);
    if (!real) real = dlsym(RTLD_NEXT, "unlinkat");
    int rc = real(d, p, flags);
    after_unlink(d, p, rc);
    return rc;
}
