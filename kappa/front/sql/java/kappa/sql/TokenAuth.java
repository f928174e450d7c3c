package kappa.sql;

import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;

import javax.security.sasl.AuthenticationException;

import org.apache.hive.service.auth.PasswdAuthenticationProvider;

/**
 * The JDBC (HiveServer2 protocol) endpoint's credential check: the password must be the service's token (the
 * environment variable {@code KAPPA_SQL_TOKEN}); the user name is free (it names the client in the logs).
 */
public final class TokenAuth implements PasswdAuthenticationProvider {

    @Override
    public void Authenticate(String user, String password) throws AuthenticationException {
        String expected = System.getenv("KAPPA_SQL_TOKEN");
        if (expected == null || expected.isEmpty()) {
            throw new AuthenticationException("kappa sql: the service has no token (KAPPA_SQL_TOKEN): it admits nobody");
        }
        byte[] given = password == null ? new byte[0] : password.getBytes(StandardCharsets.UTF_8);
        if (!MessageDigest.isEqual(expected.getBytes(StandardCharsets.UTF_8), given)) {
            throw new AuthenticationException("kappa sql: wrong or missing token (the password is the service's token)");
        }
    }
}
