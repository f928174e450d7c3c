package kappa.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;

import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * Hadoop's local file system without a process per file operation.
 *
 * <p>Without Hadoop's native library (pyspark ships none) {@link RawLocalFileSystem} sets a file's permission by
 * running {@code chmod} and asks whether a path is a symbolic link by running {@code readlink}: a process started
 * by the JVM for every checkpoint, state-store and Delta log file a micro-batch writes (20 for each micro-batch of a
 * query that does nothing). Both are one system call through {@code java.nio} here; what the files hold, where
 * they go and the atomic renames Spark's checkpoints rely on are {@link RawLocalFileSystem}'s, unchanged.
 */
public class ForklessRawLocalFileSystem extends RawLocalFileSystem {
    /** POSIX permissions by bit, lowest first (others execute = 0001 ... owner read = 0400). */
    private static final PosixFilePermission[] BITS = {
        PosixFilePermission.OTHERS_EXECUTE, PosixFilePermission.OTHERS_WRITE, PosixFilePermission.OTHERS_READ,
        PosixFilePermission.GROUP_EXECUTE, PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_READ,
        PosixFilePermission.OWNER_EXECUTE, PosixFilePermission.OWNER_WRITE, PosixFilePermission.OWNER_READ};

    static Set<PosixFilePermission> posix(FsPermission permission) {
        short mode = permission.toShort();
        Set<PosixFilePermission> set = EnumSet.noneOf(PosixFilePermission.class);
        for (int i = 0; i < BITS.length; i++) {
            if ((mode & (1 << i)) != 0) {
                set.add(BITS[i]);
            }
        }
        return set;
    }

    @Override
    public void setPermission(Path p, FsPermission permission) throws IOException {
        if ((permission.toShort() & 07000) != 0) {  // setuid, setgid, sticky: java.nio has no word for them
            super.setPermission(p, permission);
            return;
        }
        Files.setPosixFilePermissions(pathToFile(p).toPath(), posix(permission));
    }

    /** A path that is no symbolic link has the status {@link #getFileStatus} gives; a link is left to Hadoop. */
    @Override
    public FileStatus getFileLinkStatus(Path f) throws IOException {
        if (Files.isSymbolicLink(pathToFile(f).toPath())) {
            return super.getFileLinkStatus(f);
        }
        return getFileStatus(f);
    }
}
