package kappa.hadoop;

import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.ChecksumFs;
import org.apache.hadoop.fs.DelegateToFileSystem;
import org.apache.hadoop.fs.FsConstants;
import org.apache.hadoop.fs.FsServerDefaults;
import org.apache.hadoop.fs.local.LocalConfigKeys;

/**
 * {@code fs.AbstractFileSystem.file.impl} (the {@code FileContext} API Spark's checkpoint files and Delta's log
 * store use): Hadoop's {@code LocalFs}, checksummed, over {@link ForklessRawLocalFileSystem} instead of its own
 * {@code RawLocalFs}, whose link check runs {@code readlink} directly.
 */
public class ForklessLocalFs extends ChecksumFs {
    public ForklessLocalFs(URI uri, Configuration conf) throws IOException, URISyntaxException {
        super(new Raw(uri, conf));  // ChecksumFs hands the port, server defaults and name checks to it
    }

    /** Hadoop's {@code RawLocalFs}: link status and targets from the file system below. */
    static final class Raw extends DelegateToFileSystem {
        Raw(URI uri, Configuration conf) throws IOException, URISyntaxException {
            super(uri, new ForklessRawLocalFileSystem(), conf, FsConstants.LOCAL_FS_URI.getScheme(), false);
        }

        @Override
        public int getUriDefaultPort() {
            return -1;
        }

        @Override
        @SuppressWarnings("deprecation")  // overridden as Hadoop's RawLocalFs overrides it
        public FsServerDefaults getServerDefaults() throws IOException {
            return LocalConfigKeys.getServerDefaults();
        }

        @Override
        public boolean isValidName(String src) {
            return true;  // as Hadoop's: the operating system says what a valid name is
        }
    }
}
